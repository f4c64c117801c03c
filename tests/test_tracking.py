"""Experiment tracking (--report-to): TensorBoard event files that read back equal to the JSONL
metrics (SFT and the reward model through transformers' integration; GRPO, with its watchdog
events, and DPO through our tracker, DPO across a kill and resume); MLflow's file store and
Trackio's SQLite store read back the same way with their own readers (SFT, GRPO with its events,
DPO killed and resumed into the one run); a stored run's resume logging no step twice, and the
refusals: an unknown tracker, a library that is not installed, and none writing nothing."""

import json
import os
import sys
import types
from collections import defaultdict

import pytest

from slm_align.config import load_recipe
from slm_align.pipeline import run_preference
from slm_align.sft.stage import run_sft
from slm_align.tracking import TensorBoardTracker, open_tracker, scalars
from tests.helpers import finished_sft_run, run_cli
from tests.preference.test_dpo_kto import fresh_run, learnable_rows, preference_recipe, write_rows

pytest.importorskip("tensorboard")

# no telemetry from the trackers' libraries: MLflow decides at its import, Gradio (under Trackio) when it reports
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run directory as tensorboard's own reader sees it:
    tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def jsonl_scalars(lines: list[dict], tag_of) -> dict[str, list[tuple[int, float]]]:
    """The numbers of JSONL metric lines in the same shape: tag -> [(step, value)],
    each line at its ``step``."""
    found = defaultdict(list)
    for line in lines:
        step = line["step"]
        for key, value in scalars(line).items():
            if key != "step":
                found[tag_of(key)].append((step, value))
    return dict(found)


def assert_same(logged: dict, read_back: dict) -> None:
    """Equal tags, steps and values (TensorBoard keeps float32)."""
    assert sorted(logged) == sorted(read_back)
    for tag, points in logged.items():
        assert [step for step, _ in sorted(read_back[tag])] == [step for step, _ in sorted(points)], tag
        assert [value for _, value in sorted(read_back[tag])] == pytest.approx(
            [value for _, value in sorted(points)], rel=1e-6, nan_ok=True), tag


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def trainer_tag(key: str) -> str:
    """transformers' names in TensorBoard (its rewrite_logs): eval_loss ->
    eval/loss, loss -> train/loss."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return "train/" + key


def test_sft_with_tensorboard_writes_the_logged_metrics_and_the_recipe(tmp_path, tiny_models, stories):
    recipe = load_recipe(overrides={"model.source": str(tiny_models["llama"]), "data.path": str(stories),
                                    "sft.max_steps": 20, "sft.batch_size": 4, "data.max_length": 96,
                                    "tracking.report_to": "tensorboard"})
    run_sft(recipe, tmp_path / "run")
    logged = read_jsonl(tmp_path / "run" / "sft" / "log.jsonl")
    assert any("loss" in line for line in logged) and any("eval_loss" in line for line in logged)
    directory = tmp_path / "run" / "tracking" / "sft"
    assert_same(jsonl_scalars(logged, trainer_tag), tensorboard_scalars(directory))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    text = accumulator.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == recipe.model_dump(mode="json")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("tracking") / "run", tiny_models["llama"], stories, steps=2)


def test_report_to_none_writes_nothing(sft_run):
    out, recipe = sft_run
    assert recipe.tracking.report_to == "none"
    assert (out / "sft" / "manifest.json").is_file()
    assert not (out / "tracking").exists()


def test_a_killed_and_resumed_dpo_run_reads_back_each_step_once_equal_to_its_jsonl(sft_run, tmp_path, monkeypatch):
    _, logged = killed_and_resumed_dpo(sft_run, tmp_path, monkeypatch, TensorBoardTracker, "tensorboard")
    directory = tmp_path / "run" / "tracking" / "dpo"
    assert len(list(directory.glob("events.out.tfevents.*"))) == 2  # the killed attempt's file and the resumed one's
    read_back = tensorboard_scalars(directory)
    assert [step for step, _ in read_back["loss"]] == list(range(1, 13))  # steps 5 and 6 once, the resumed values
    assert_same(jsonl_scalars(logged, str), read_back)


def with_tracker(recipe, report_to: str):
    return recipe.model_copy(update={"tracking": recipe.tracking.model_copy(update={"report_to": report_to})})


def with_tensorboard(recipe):
    return with_tracker(recipe, "tensorboard")


def tensorboard_texts(directory, tag: str) -> list[tuple[int, str]]:
    """The text summaries of ``tag`` as tensorboard's reader sees them: [(step, text)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [(event.step, event.tensor_proto.string_val[0].decode()) for event in accumulator.Tensors(tag)]


def grpo_with_a_watchdog_event(sft_run, out, report_to: str):
    """A 5-step GRPO run whose watchdog fires (KL runaway at the 2nd step), reporting to ``report_to``: its
    recipe, JSONL metrics and events."""
    import shutil

    from slm_align.pipeline import run_rl

    base, recipe = sft_run
    shutil.copytree(base / "sft", out / "sft")
    watchdog = recipe.rl.watchdog.model_copy(update=dict(  # only KL runaway, at any KL: an event at the 2nd step
        window=1, max_kl=1e-9, entropy_floor=0.0, length_ratio=0.0, truncated_rise=0.0, zero_std_rise=0.0,
        max_recoveries=1, eval_every=2, probe_prompts=2))
    rl = recipe.rl.model_copy(update=dict(algo="grpo", steps=5, save_steps=5, prompts_per_step=2, group_size=2,
                                          max_new_tokens=6, eval_prompts=2, learning_rate=1e-2, report_prompts=0,
                                          watchdog=watchdog))
    headroom = recipe.headroom.model_copy(update=dict(spread_prompts=2, samples_per_prompt=2, max_new_tokens=6,
                                                      max_documents=8))
    recipe = with_tracker(recipe.model_copy(update={"rl": rl, "headroom": headroom}), report_to)
    run_rl(recipe, out, rewards=["length_window"], force=True)
    logged = read_jsonl(out / "rl" / "metrics.jsonl")
    assert [line["step"] for line in logged] == list(range(1, len(logged) + 1))
    assert any("watchdog/probe_reward" in line for line in logged)
    events = read_jsonl(out / "rl" / "events.jsonl")
    assert [event["detector"] for event in events][:1] == ["kl_runaway"]
    return recipe, logged, events


def test_a_grpo_run_reads_back_equal_to_its_jsonl_and_its_watchdog_events_reach_tensorboard(sft_run, tmp_path):
    out = tmp_path / "run"
    recipe, logged, events = grpo_with_a_watchdog_event(sft_run, out, "tensorboard")
    directory = out / "tracking" / "rl"
    assert_same(jsonl_scalars(logged, str), tensorboard_scalars(directory))
    read_back = tensorboard_texts(directory, "watchdog/events/text_summary")
    assert [(step, json.loads(text)) for step, text in read_back] == [(event["step"], event) for event in events]
    recipe_text = tensorboard_texts(directory, "recipe/text_summary")[0][1]
    assert json.loads(recipe_text.removeprefix("```json\n").removesuffix("\n```")) == recipe.model_dump(mode="json")


def test_the_reward_stage_with_tensorboard_reads_back_equal_to_its_log(sft_run, tmp_path):
    import shutil

    from slm_align.reward_model.stage import run_reward

    base, recipe = sft_run
    out = tmp_path / "run"
    shutil.copytree(base / "sft", out / "sft")
    reward = recipe.reward.model_copy(update={"max_steps": 10, "batch_size": 4})
    run_reward(with_tensorboard(recipe.model_copy(update={"reward": reward})), out)
    logged = read_jsonl(out / "reward" / "log.jsonl")
    assert any("loss" in line for line in logged)
    assert_same(jsonl_scalars(logged, trainer_tag), tensorboard_scalars(out / "tracking" / "reward"))


class FakeWandb(types.ModuleType):
    """Records what a tracker asks of wandb: init arguments and (step, values) per run id."""

    def __init__(self):
        super().__init__("wandb")
        self.inits = []
        self.logged = defaultdict(list)

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run_id = kwargs["id"] or f"run{len(self.inits)}"
        logged = self.logged[run_id]

        def log(values, step):
            logged.append((step, values))

        return types.SimpleNamespace(id=run_id, log=log, finish=lambda: None)


def test_wandb_is_offline_with_the_recipe_as_config_and_a_resume_logs_no_step_twice(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    recipe = load_recipe(overrides={"tracking.report_to": "wandb"})
    killed = open_tracker(recipe, tmp_path, "rl")
    for step in (1, 2, 3):
        killed.log(step, {"reward/mean": step, "watchdog/event": "entropy_collapse"})
    resumed = open_tracker(recipe, tmp_path, "rl", resume_step=1)  # the checkpoint was at step 1
    for step in (2, 3, 4):  # as in RL: a step's event, then its metrics
        resumed.event(step, {"step": step, "detector": "kl_runaway"})
        resumed.log(step, {"reward/mean": 10 * step})
    resumed.close()
    first, second = fake.inits
    assert first["mode"] == "offline" and first["config"] == recipe.model_dump(mode="json")
    assert first["dir"] == str(tmp_path / "tracking" / "rl") and first["id"] is None
    assert second["id"] == "run1" and second["resume"] == "allow"
    steps = [step for step, _ in fake.logged["run1"]]
    assert steps == [1, 2, 3, 4, 4]  # 2 and 3 were in the run already; step 4's event and its metrics
    assert fake.logged["run1"][0][1] == {"reward/mean": 1.0}  # the string metric is not a scalar
    assert json.loads(fake.logged["run1"][3][1]["watchdog/events"])["detector"] == "kl_runaway"
    assert fake.logged["run1"][4][1] == {"reward/mean": 40.0}


def test_an_unknown_tracker_is_refused_in_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "sft", "--report-to", "neptune", "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "tracking.report_to" in err and "tensorboard" in err
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch, stories):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    code, _, err = run_cli(capsys, "sft", "--data", stories, "--report-to", "mlflow", "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "pip install mlflow" in err
    assert not (tmp_path / "run").exists()


# MLflow and Trackio, installed by the dev extra: a short real run in a local store (no server, no hub), read
# back with each library's own reader.


def killed_and_resumed_dpo(sft_run, tmp_path, monkeypatch, tracker_class, report_to: str):
    """A DPO run (12 steps, checkpoints every 4) killed once step 6 reached the JSONL and the tracker, then
    resumed from step 4: its recipe and JSONL metrics, each line with its step."""
    prefs = write_rows(tmp_path / "prefs.jsonl", learnable_rows(60))
    recipe = preference_recipe(fresh_run(sft_run, tmp_path / "run"), "dpo", prefs, steps=12, save_steps=4,
                               eval_every=4)
    recipe = with_tracker(recipe, report_to)
    original = tracker_class.log

    def log_then_die_at_six(self, step, metrics):
        original(self, step, metrics)
        if step == 6:
            raise KeyboardInterrupt

    monkeypatch.setattr(tracker_class, "log", log_then_die_at_six)
    with pytest.raises(KeyboardInterrupt):
        run_preference(recipe, tmp_path / "run", force=True)
    monkeypatch.setattr(tracker_class, "log", original)
    run_preference(recipe, tmp_path / "run", force=True, resume=True)
    logged = [dict(line, step=step) for step, line in
              enumerate(read_jsonl(tmp_path / "run" / "dpo" / "metrics.jsonl"), start=1)]
    assert len(logged) == 12 and "heldout/pair_accuracy" in logged[3]
    return recipe, logged


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """MLflow's tracking URI left unset: the tracker picks its file store under the run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def mlflow_runs(store) -> tuple:
    """The runs of the slm-align experiment in a file store, as MLflow's client reads them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("slm-align")
    return client, client.search_runs([experiment.experiment_id])


def mlflow_scalars(client, run, keys) -> dict[str, list[tuple[int, float]]]:
    return {key: [(metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key)]
            for key in keys}


def test_sft_with_mlflow_logs_the_trainer_metrics_and_the_recipe_into_one_run(tmp_path, tiny_models, stories,
                                                                             mlflow_store):
    recipe = load_recipe(overrides={"model.source": str(tiny_models["llama"]), "data.path": str(stories),
                                    "sft.max_steps": 20, "sft.batch_size": 4, "data.max_length": 96,
                                    "tracking.report_to": "mlflow"})
    run_sft(recipe, tmp_path / "run")
    logged = read_jsonl(tmp_path / "run" / "sft" / "log.jsonl")
    client, runs = mlflow_runs(tmp_path / "run" / "tracking" / "sft" / "mlruns")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "sft" and run.info.status == "FINISHED"
    expected = jsonl_scalars(logged, str)
    assert "loss" in expected and "eval_loss" in expected
    assert_same(expected, mlflow_scalars(client, run, expected))
    assert run.data.params["max_steps"] == "20"  # transformers' TrainingArguments as params
    recipe_file = client.download_artifacts(run.info.run_id, "recipe.json", str(tmp_path))
    assert json.loads(open(recipe_file, encoding="utf-8").read()) == recipe.model_dump(mode="json")


def test_a_killed_and_resumed_dpo_run_continues_its_mlflow_run_each_step_once(sft_run, tmp_path, monkeypatch,
                                                                             mlflow_store):
    from slm_align.tracking import MlflowTracker

    recipe, logged = killed_and_resumed_dpo(sft_run, tmp_path, monkeypatch, MlflowTracker, "mlflow")
    directory = tmp_path / "run" / "tracking" / "dpo"
    client, runs = mlflow_runs(directory / "mlruns")
    assert len(runs) == 1  # the resumed attempt continued the killed one's run
    run = runs[0]
    assert run.info.run_id == json.loads((directory / "run.json").read_text())["run_id"]
    assert run.info.run_name == "dpo" and run.info.status == "FINISHED"
    expected = jsonl_scalars(logged, str)
    read_back = mlflow_scalars(client, run, expected)
    assert [step for step, _ in read_back["loss"]] == list(range(1, 13))  # steps 5 and 6 once
    assert_same(expected, read_back)
    assert sorted(run.data.metrics) == sorted(expected)  # nothing else was logged
    recipe_file = client.download_artifacts(run.info.run_id, "recipe.json", str(tmp_path))
    assert json.loads(open(recipe_file, encoding="utf-8").read()) == recipe.model_dump(mode="json")


@pytest.fixture
def trackio_store(tmp_path, monkeypatch):
    """Trackio's local store in ``tmp_path/trackio`` (it reads TRACKIO_DIR once, at import), no Space."""
    import trackio
    import trackio.sqlite_storage
    import trackio.utils

    store = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    for module in (trackio, trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", store)
    for name in ("TRACKIO_SPACE_ID", "TRACKIO_PROJECT", "TRACKIO_DATASET_ID"):
        monkeypatch.delenv(name, raising=False)
    return store


def trackio_run(directory) -> tuple[str, list[dict], dict]:
    """The stage's Trackio run (its name from ``run.json``), as Trackio's own storage reads it: (name, logs,
    config), each log a dict of the values with its ``step``."""
    from trackio.sqlite_storage import SQLiteStorage

    name = json.loads((directory / "run.json").read_text(encoding="utf-8"))["run_id"]
    assert SQLiteStorage.get_runs("slm-align") == [name]
    return name, SQLiteStorage.get_logs("slm-align", name), SQLiteStorage.get_run_config("slm-align", name)


def trackio_scalars(logs: list[dict], tag_of=str, step_key="step") -> dict[str, list[tuple[int, float]]]:
    found = defaultdict(list)
    for line in logs:
        for key, value in line.items():
            if (key not in ("step", "timestamp", "train/global_step") and isinstance(value, (int, float))
                    and not isinstance(value, bool)):
                found[tag_of(key)].append((line[step_key], value))
    return dict(found)


def test_sft_with_trackio_logs_the_trainer_metrics_locally_into_the_stage_run(tmp_path, tiny_models, stories,
                                                                              trackio_store):
    recipe = load_recipe(overrides={"model.source": str(tiny_models["llama"]), "data.path": str(stories),
                                    "sft.max_steps": 20, "sft.batch_size": 4, "data.max_length": 96,
                                    "tracking.report_to": "trackio"})
    run_sft(recipe, tmp_path / "run")  # no Space: transformers' callback would deploy to one by default
    logged = read_jsonl(tmp_path / "run" / "sft" / "log.jsonl")
    name, logs, config = trackio_run(tmp_path / "run" / "tracking" / "sft")
    assert name.startswith("sft-") and (trackio_store / "slm-align.db").is_file()
    summary = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos"}
    expected = jsonl_scalars([{k: v for k, v in line.items() if k not in summary} for line in logged], trainer_tag)
    assert "train/loss" in expected and "eval/loss" in expected
    assert_same(expected, trackio_scalars(logs, step_key="train/global_step"))  # transformers' x-axis
    assert config["max_steps"] == 20 and config["seed"] == recipe.seed  # transformers' TrainingArguments


def test_a_killed_and_resumed_dpo_run_continues_its_trackio_run_each_step_once(sft_run, tmp_path, monkeypatch,
                                                                              trackio_store):
    from slm_align.tracking import TrackioTracker

    recipe, logged = killed_and_resumed_dpo(sft_run, tmp_path, monkeypatch, TrackioTracker, "trackio")
    name, logs, config = trackio_run(tmp_path / "run" / "tracking" / "dpo")  # one run: the resumed one continued it
    assert name.startswith("dpo-")
    assert [line["step"] for line in logs] == list(range(1, 13))  # steps 5 and 6 once
    assert_same(jsonl_scalars(logged, str), trackio_scalars(logs))
    assert {key: config[key] for key in config if not key.startswith("_")} == recipe.model_dump(mode="json")


def test_a_grpo_run_reads_back_from_mlflow_equal_to_its_jsonl_with_its_watchdog_events(sft_run, tmp_path,
                                                                                      mlflow_store):
    out = tmp_path / "run"
    recipe, logged, events = grpo_with_a_watchdog_event(sft_run, out, "mlflow")
    client, runs = mlflow_runs(out / "tracking" / "rl" / "mlruns")
    run = runs[0]
    assert len(runs) == 1 and run.info.run_name == "rl"
    expected = jsonl_scalars(logged, str)
    assert_same(expected, mlflow_scalars(client, run, expected))
    names = sorted(item.path for item in client.list_artifacts(run.info.run_id, "watchdog"))
    assert names == [f"watchdog/step-{event['step']:06d}-{event['detector']}.json" for event in events]
    read_back = [json.loads(open(client.download_artifacts(run.info.run_id, name, str(tmp_path)),
                                 encoding="utf-8").read()) for name in names]
    assert read_back == events


def test_a_grpo_run_reads_back_from_trackio_equal_to_its_jsonl_with_its_watchdog_events(sft_run, tmp_path,
                                                                                       trackio_store):
    out = tmp_path / "run"
    recipe, logged, events = grpo_with_a_watchdog_event(sft_run, out, "trackio")
    name, logs, config = trackio_run(out / "tracking" / "rl")
    assert name.startswith("rl-")
    assert_same(jsonl_scalars(logged, str), trackio_scalars(logs))
    read_back = [(line["step"], json.loads(line["watchdog/events"])) for line in logs if "watchdog/events" in line]
    assert read_back == [(event["step"], event) for event in events]
    assert {key: config[key] for key in config if not key.startswith("_")} == recipe.model_dump(mode="json")
