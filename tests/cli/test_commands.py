"""The command line: every command has help, bad input is one line and exit 2, and
nothing is overwritten."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import run_cli, tree_digest

COMMANDS = ["quickstart", "sft", "check-headroom", "train", "evaluate", "merge", "export", "bundle", "bundle-keygen",
            "chat", "feedback export", "devices list", "devices show", "devices fit", "bench", "serve",
            "tasks make", "evaluate-agent", "env", "field simulate"]



@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(capsys, command):
    code, out, _ = run_cli(capsys, *command.split(), "--help")
    assert code == 0 and "Example" in out and "--json" in out


def test_bad_rl_settings_are_refused_before_any_work(capsys, tmp_path):
    for args, expected in ((["--algo", "a2c"], "rl.algo"), (["--group-size", "1"], "rl.group_size"),
                           (["--loss-type", "mean"], "rl.grpo.loss_type"), (["--stage", "dpo"], "--stage dpo")):
        code, out, err = run_cli(capsys, "train", "--out", tmp_path / "run", *args)
        assert code == 2 and expected in err and err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_train_grpo_from_the_cli_with_a_reward_function(capsys, tmp_path, tiny_models, stories):
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "--algo", "grpo", "--model", tiny_models["qwen2"], "--data", stories,
                                "--out", out, "--reward", "length_window", "--steps", "2", "--prompts-per-step", "2",
                                "--group-size", "2", "--max-new-tokens", "8", "--force", "--report-prompts", "0",
                                "--json")
    summary = json.loads(stdout)
    assert code == 0, err
    assert summary["metrics"]["algo"] == "grpo" and summary["metrics"]["steps"] == 2
    assert "evaluation" not in summary and not (out / "eval").exists()  # --report-prompts 0: no closing report
    assert (out / "sft" / "manifest.json").is_file() and not (out / "reward").exists()  # a function, no model
    assert len((out / "rl" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.txt").write_text("")
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (root / "nocol.jsonl").write_text('{"title": "a"}\n')
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "tiny.txt").write_text("one\n\ntwo\n")
    (root / "data.xml").write_text("<a/>")
    (root / "bad.toml").write_text("[sft\nlr = 1")
    (root / "unknown.toml").write_text("[sft]\nlearnin_rate = 0.1\n")
    bert = root / "bert"
    shutil.copytree(tiny_models["llama"], bert)
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    pickled = root / "pickled"
    shutil.copytree(tiny_models["llama"], pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({}, pickled / "pytorch_model.bin")
    corrupt = root / "corrupt"
    shutil.copytree(tiny_models["llama"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    return root


CASES = {
    "missing data path": (["--data", "{root}/nope.jsonl"], "not found"),
    "empty data file": (["--data", "{root}/empty.txt"], "holds no documents"),
    "malformed jsonl line": (["--data", "{root}/broken.jsonl"], "broken.jsonl:2: not valid JSON"),
    "no text column": (["--data", "{root}/nocol.jsonl"], "no text column"),
    "missing named column": (["--data", "{root}/broken.jsonl", "--text-field", "body"], "no column 'body'"),
    "wrong encoding": (["--data", "{root}/latin.txt"], "not UTF-8"),
    "too few documents": (["--data", "{root}/tiny.txt"], "need at least"),
    "unsupported data format": (["--data", "{root}/data.xml"], "unsupported format"),
    "missing model": (["--model", "{root}/no-model"], "not found"),
    "unsupported architecture": (["--model", "{root}/bert"], "unsupported architecture 'bert'"),
    "pickle checkpoint": (["--model", "{root}/pickled"], "pickle"),
    "corrupt safetensors": (["--model", "{root}/corrupt"], "cannot be loaded"),
    "offline hub id": (["--model", "nobody/nothing-here"], "Hugging Face Hub"),
    "non-numeric flag": (["--lr", "fast"], "Invalid value for '--lr'"),
    "out-of-range rank": (["--lora-r", "0"], "sft.lora.r"),
    "out-of-range learning rate": (["--lr", "-1"], "sft.learning_rate"),
    "unknown flag": (["--lerning-rate", "1"], "No such option"),
    "invalid TOML": (["--config", "{root}/bad.toml"], "not valid TOML"),
    "unknown TOML setting": (["--config", "{root}/unknown.toml"], "learnin_rate"),
    "missing config": (["--config", "{root}/none.toml"], "not found"),
    "LoRA targets that do not exist": (["--lora-targets", "nonexistent_proj"], "--lora-targets"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, bad_inputs, tmp_path, tiny_models, stories, case):
    args, expected = CASES[case]
    args = [a.format(root=bad_inputs) for a in args]
    if "--model" not in args:
        args += ["--model", str(tiny_models["llama"])]
    if "--data" not in args:
        args += ["--data", str(stories)]
    out = tmp_path / "run"
    (out / "notes").mkdir(parents=True)
    (out / "keep.txt").write_text("earlier result")
    before = tree_digest(out)
    code, stdout, stderr = run_cli(capsys, "sft", "--out", out, "--max-steps", "1", *args)
    assert code == 2, stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert expected in stderr
    assert stdout == ""
    assert tree_digest(out) == before and sorted(p.name for p in out.iterdir()) == ["keep.txt", "notes"]


def test_headroom_on_a_run_without_sft_is_a_user_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "check-headroom", "--run", tmp_path)
    assert code == 2 and "no finished SFT stage" in err


def test_sft_then_headroom_from_the_cli_with_json_and_exit_codes(capsys, tmp_path, tiny_models, stories):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(capsys, "sft", "--model", tiny_models["gpt_neox"], "--data", stories, "--out", out,
                              "--max-steps", "3", "--batch-size", "4", "--max-length", "64", "--json")
    summary = json.loads(stdout)
    assert code == 0 and summary["metrics"]["steps"] == 3 and not summary["skipped"]
    code, stdout, _ = run_cli(capsys, "check-headroom", "--run", out, "--max-ppl", "1e9", "--json")
    report = json.loads(stdout)
    assert code == 0 and report["verdict"] == "PASS"
    assert report["figures"][0]["name"] == "held-out perplexity" and report["info"]["base_ppl"] > 1
    code, stdout, _ = run_cli(capsys, "check-headroom", "--run", out, "--max-ppl", "1.5")
    assert code == 1 and "FAIL" in stdout and "LoRA rank" in stdout


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "slm_align", "sft", "--help"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "NEFTune" in result.stdout


def test_evaluate_adds_a_baseline_row_under_the_same_reward(capsys, tmp_path, tiny_models, stories):
    out = tmp_path / "run"
    run_cli(capsys, "sft", "--model", tiny_models["llama"], "--data", stories, "--out", out, "--max-steps", "2",
            "--batch-size", "4", "--max-length", "64")
    capsys.readouterr()
    code, stdout, err = run_cli(capsys, "evaluate", "--run", out, "--baseline", tiny_models["qwen2"], "--reward",
                                "length_window", "--prompts", "4", "--max-new-tokens", "8", "--json")
    report = json.loads(stdout)
    assert code == 0, err
    assert [p["name"] for p in report["policies"]] == ["sft", str(tiny_models["qwen2"])]
    assert report["prompts"] == 4 and report["reward_terms"] == ["length_window"]
    comparison = report["comparisons"][0]
    low = comparison["delta_ci95"][0]
    high = comparison["delta_ci95"][1]
    assert comparison["baseline"] == "sft" and low <= comparison["delta"] <= high
    markdown = (out / "eval" / "report.md").read_text()
    assert "| sft |" in markdown and "95% CI" in markdown and (out / "eval" / "reward_distributions.png").is_file()


def test_recipe_flags_take_help_and_default_from_the_recipe_field():
    from slm_align.cli.options import recipe_field, recipe_help, recipe_option
    from slm_align.config import Recipe

    beta = recipe_field("rl.grpo.beta")
    assert beta.default == Recipe().rl.grpo.beta and beta.info.description.startswith("GRPO: coefficient")
    assert recipe_field("rl.lora.dropout").default == Recipe().rl.lora.dropout  # a default_factory's own value
    with pytest.raises(KeyError):
        recipe_field("rl.no_such_setting")
    option = recipe_option("sft.learning_rate", "--lr")
    assert option.default is None and option.help == recipe_field("sft.learning_rate").info.description
    assert option.show_default == f"{Recipe().sft.learning_rate:g}"
    assert recipe_help("rl.algo").endswith("One of: ppo, grpo, auto, dpo, kto.")


def help_panels(text: str) -> dict[str, list[str]]:
    """The options of a rendered ``--help``, by the panel they are listed
    in (in the order shown)."""
    panels, current = {}, None
    for line in text.splitlines():
        title = re.match(r"╭─ (.+?) ─", line)
        if title:
            current = panels.setdefault(title.group(1), [])
        elif current is not None and (option := re.match(r"│ (--[\w-]+)", line)):
            current.append(option.group(1))
    return panels


def test_train_help_lists_each_algorithm_and_guard_in_its_own_panel(capsys, monkeypatch):
    import typer

    from slm_align.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    code, out, _ = run_cli(capsys, "train", "--help")
    panels = help_panels(out)
    assert code == 0 and list(panels) == ["Options", "Source", "Data", "Reward model",
                                          "Headroom gate", "RL (common)",
                                          "PPO", "GRPO", "Safety envelope",
                                          "Watchdog", "DPO / KTO", "KTO",
                                          "Compute", "Tracking"]
    expected = {"Options": ["--out", "--stage", "--set", "--force", "--resume"],
                "Source": ["--model", "--allow-pickle"], "Data": ["--data", "--tasks", "--seed"],
                "Reward model": ["--preferences", "--pair-mix"],
                "Headroom gate": ["--max-ppl", "--gate-samples"],
                "RL (common)": ["--algo", "--steps", "--group-size", "--max-new-tokens", "--no-sft",
                                "--rl-warmup-steps"],
                "PPO": ["--kl-coef", "--kl-mode", "--adaptive-kl"],
                "GRPO": ["--beta", "--loss-type", "--scale-rewards", "--resample-zero-std", "--refill-flat"],
                "Safety envelope": ["--no-reinit-lora", "--no-ratio-guard", "--no-rollback", "--sigma-clip"],
                "Watchdog": ["--watchdog", "--watchdog-every"], "DPO / KTO": ["--pref-beta", "--pref-steps"],
                "KTO": ["--desirable-weight", "--undesirable-weight"], "Compute": ["--device", "--precision"],
                "Tracking": ["--report-to"]}
    for panel, options in expected.items():
        assert set(options) <= set(panels[panel]), (panel, panels[panel])
    listed = [option for options in panels.values() for option in options if option != "--help"]
    train = typer.main.get_command(app).commands["train"]
    assert sorted(listed) == sorted(param.opts[0] for param in train.params)  # each option once, none left out


def test_train_flags_become_recipe_overrides_and_absent_ones_leave_the_toml(tmp_path, monkeypatch):
    import slm_align.pipeline
    from slm_align.cli import main

    class Stop(Exception):
        """Raised by the stand-in for run_sft once it has seen the recipe."""

    seen = {}

    def fake_run_sft(recipe, out, resume=False):
        seen["recipe"] = recipe
        raise Stop

    monkeypatch.setattr(slm_align.pipeline, "run_sft", fake_run_sft)
    config = tmp_path / "recipe.toml"
    config.write_text('[data]\npath = "demo"\n[sft]\nlearning_rate = 0.0001\nbatch_size = 3\n')
    with pytest.raises(Stop):
        main(["train", "--stage", "sft", "--config", str(config), "--out", str(tmp_path / "run"), "--no-rollback",
              "--no-ratio-guard", "--pair-mix", "shuffle=2,truncate", "--seed", "7"])
    recipe = seen["recipe"]
    assert recipe.sft.learning_rate == 0.0001 and recipe.sft.batch_size == 3 and recipe.seed == 7
    assert recipe.data.path == "demo"  # the TOML's data.path = "demo" asks for the demo stories
    assert recipe.rl.envelope.rollback is False and recipe.rl.envelope.ratio_guard == 0.0
    assert recipe.rl.envelope.reinit_lora is True and recipe.reward.pairs.mix == {"shuffle": 2.0, "truncate": 1.0}


class Reached(Exception):
    """Raised by a stand-in stage once the command got past its checks."""


def _stop(*args, **kwargs):
    raise Reached


NO_DATA_COMMANDS = {
    "sft": ["sft"],
    "train --stage sft": ["train", "--stage", "sft"],
    "train (SFT first)": ["train"],
    "train --algo dpo (SFT first)": ["train", "--algo", "dpo", "--preferences", "prefs.jsonl"],
    "train --tasks (SFT first: tasks are no corpus)": ["train", "--tasks", "tasks.jsonl"],
    "check-headroom --model": ["check-headroom", "--model", "base", "--adapter", "adapter"],
}


@pytest.mark.parametrize("case", sorted(NO_DATA_COMMANDS))
def test_training_without_data_is_refused_naming_a_file_or_the_demo(capsys, tmp_path, case):
    out = tmp_path / "run"
    args = NO_DATA_COMMANDS[case]
    place = ["--out", out] if args[0] != "check-headroom" else []
    code, stdout, err = run_cli(capsys, *args, *place)
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert "no training data" in err and "--data FILE" in err and "--data demo" in err
    assert not out.exists()


def test_data_demo_on_the_command_line_asks_for_the_demo_stories(tmp_path, monkeypatch):
    import slm_align.sft.stage
    from slm_align.cli import main

    seen = {}

    def fake_run_sft(recipe, out, resume=False):
        seen["recipe"] = recipe
        raise Reached

    monkeypatch.setattr(slm_align.sft.stage, "run_sft", fake_run_sft)
    with pytest.raises(Reached):
        main(["sft", "--data", "demo", "--out", str(tmp_path / "run")])
    assert seen["recipe"].data.path == "demo" and seen["recipe"].data.uses_demo


def test_data_taken_from_a_finished_sft_stage_or_tasks_needs_no_data_flag(capsys, tmp_path, monkeypatch):
    import slm_align.headroom.stage
    import slm_align.pipeline

    monkeypatch.setattr(slm_align.pipeline, "run_rl", _stop)
    monkeypatch.setattr(slm_align.pipeline, "run_reward", _stop)
    monkeypatch.setattr(slm_align.headroom.stage, "check_headroom", _stop)
    run = tmp_path / "run"
    (run / "sft").mkdir(parents=True)
    (run / "sft" / "manifest.json").write_text("{}")
    for args in (["train", "--out", run], ["train", "--out", tmp_path / "new", "--sft", run],
                 ["train", "--stage", "reward", "--out", run], ["check-headroom", "--run", run],
                 ["train", "--no-sft", "--tasks", "tasks.jsonl", "--reward", "exact_answer", "--out", tmp_path / "t"],
                 ["check-headroom", "--model", "base", "--tasks", "tasks.jsonl"]):
        with pytest.raises(Reached):
            run_cli(capsys, *args)


def test_the_demo_named_or_left_unset_is_one_corpus_and_one_sft_stage():
    from slm_align.config import load_recipe
    from slm_align.data.corpus import load_corpus
    from slm_align.modeling.models import resolve_source
    from slm_align.sft.stage import sft_inputs

    unset = load_recipe(overrides={"data.demo_documents": 40})
    named = load_recipe(overrides={"data.demo_documents": 40, "data.path": "demo"})
    corpus = load_corpus(unset.data, seed=0)
    again = load_corpus(named.data, seed=0)
    assert again.fingerprint == corpus.fingerprint and again.splits.train == corpus.splits.train
    source = resolve_source(None)
    assert sft_inputs(named, source, again) == sft_inputs(unset, source, corpus)  # the stage is reused
    recorded = sft_inputs(named, source, again)
    assert recorded["where"] == {"data": None} and "path" not in recorded["data_settings"]  # one spelling
