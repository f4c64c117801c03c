"""benchmarks/function_calling.py's own logic: TRL's reward reads a function row's columns as the benchmark
hands them to ``datasets`` (JSON text) and scores them by BFCL's rules, and the headline difference pools
BFCL's four call categories without irrelevance."""

import json
from pathlib import Path

import pytest
import torch

from slm_align.data.function_tasks import DEFAULT_MIX, canonical_arguments, function_tasks
from slm_align.ondevice.agent.task_eval import TaskResult, summarize
from slm_align.ondevice.rewards.function_calls import function_call_match
from slm_align.quickstart.agent import AgentSizes, tasks_step

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import agent_tasks
    import function_calling

    return agent_tasks, function_calling


def _first(rows: list[dict], category: str) -> dict:
    return next(row for row in rows if row["category"] == category)


def _reply(calls: list[dict]) -> str:
    return "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)


def _right_calls(row: dict) -> list[dict]:
    return [{"name": name, "arguments": canonical_arguments(allowed)}
            for entry in row["ground_truth"] for name, allowed in entry.items()]


def _wrong_value(row: dict) -> list[dict]:
    """The right call with one required argument given a value no rule allows."""
    calls = _right_calls(row)
    name = calls[0]["name"]
    tool = next(t["function"] for t in row["tools"] if t["function"]["name"] == name)
    argument = tool["parameters"]["required"][0]
    calls[0]["arguments"][argument] = "not-a-value-anyone-allows-123"
    return calls


def _no_calls(row: dict) -> list[dict]:
    return []


def _offered_call(row: dict) -> list[dict]:
    """A call of the first function the row offers (on an irrelevance row, a call that should not be)."""
    return [{"name": row["tools"][0]["function"]["name"], "arguments": {}}]


def test_trl_reward_scores_rows_through_a_dataset(bench):
    """Rows go through ``trl_columns`` and ``datasets.Dataset`` as TRL reads them; the reward gives a right
    call 1, a wrong argument value 0, no call on irrelevance 1 and a call on irrelevance 0."""
    datasets = pytest.importorskip("datasets")
    agent_tasks, function_calling = bench
    rows = function_tasks(train=60, heldout=20, seed=0)["train"]
    cases = [(_first(rows, "simple"), _right_calls, 1.0), (_first(rows, "simple"), _wrong_value, 0.0),
             (_first(rows, "parallel_multiple"), _right_calls, 1.0),
             (_first(rows, "irrelevance"), _no_calls, 1.0), (_first(rows, "irrelevance"), _offered_call, 0.0)]
    chosen = [row for row, _, _ in cases]
    table = datasets.Dataset.from_dict({"prompt": ["p"] * len(chosen),
                                        **agent_tasks.trl_columns(chosen, function_calling.COLUMNS)})
    batch = table[:]
    completions = [_reply(make(row)) if make(row) else "No function here fits, sorry." for row, make, _ in cases]
    kwargs = {name: batch[name] for name in function_calling.COLUMNS}
    scores = function_call_match(batch["prompt"], completions, **kwargs)
    assert scores == [expected for _, _, expected in cases]


def _results(successes: dict[str, list[bool]]) -> dict:
    rows = []
    for group, wins in successes.items():
        for index, win in enumerate(wins):
            rows.append(TaskResult(question=f"{group}{index}", answer="", reply="", calls=1, valid_calls=1,
                                   rounds=0, tokens=1, category="success" if win else "wrong_answer",
                                   group=group, task=len(rows)).__dict__)
    return {"results": rows}


def test_call_categories_pool_without_irrelevance(bench):
    """ours - SFT on BFCL's calls: the four call categories only (ours wins 2 of 8 there, and every
    irrelevance row, which must not count)."""
    _, function_calling = bench
    baseline = {"simple_python": [False, False], "multiple": [False, False], "parallel": [False, False],
                "parallel_multiple": [False, False], "irrelevance": [False] * 4}
    candidate = dict(baseline, simple_python=[True, True], irrelevance=[True] * 4)
    heldout = _results({"simple": [True, False]})
    evaluated = {"SFT-small": {"heldout": heldout, "bfcl": _results(baseline)},
                 "ours": {"heldout": heldout, "bfcl": _results(candidate)}}
    found = function_calling.differences(evaluated, pairs=(("ours", "SFT-small"),))
    assert found["ours - SFT-small [bfcl_calls]"]["success_delta"] == pytest.approx(2 / 8)
    assert found["ours - SFT-small [bfcl_irrelevance]"]["success_delta"] == pytest.approx(1.0)
    assert found["ours - SFT-small [heldout]"]["success_delta"] == 0.0
    pooled = summarize(function_calling.results_in(_results(candidate), function_calling.CALL_CATEGORIES))
    assert pooled["episodes"] == 8
    assert pooled["success_rate"] == pytest.approx(0.25)


def test_an_evaluation_is_kept_under_what_it_judged(bench, tmp_path):
    """A rerun with another BFCL limit or reply budget judges again; the same settings find the same file."""
    _, function_calling = bench
    args = function_calling.parse_args(["--work", str(tmp_path), "--limit", "10", "--judge-tokens", "128"])
    more = function_calling.parse_args(["--work", str(tmp_path), "--limit", "30", "--judge-tokens", "128"])
    longer = function_calling.parse_args(["--work", str(tmp_path), "--limit", "10", "--judge-tokens", "256"])
    kept = function_calling.eval_file(args, tmp_path, "bfcl", "ours")
    assert kept == function_calling.eval_file(args, tmp_path, "bfcl", "ours")
    assert kept != function_calling.eval_file(more, tmp_path, "bfcl", "ours")
    assert kept != function_calling.eval_file(longer, tmp_path, "bfcl", "ours")
    assert function_calling.eval_file(args, tmp_path, "heldout", "ours") == (
        function_calling.eval_file(more, tmp_path, "heldout", "ours"))
    ruled = function_calling.parse_args(["--work", str(tmp_path), "--limit", "10", "--judge-tokens", "128",
                                         "--call-threshold", "0.5"])
    for suite in ("bfcl", "heldout"):  # judged under the call rule: never the rule-free evaluation
        assert function_calling.eval_file(ruled, tmp_path, suite, "ours") != (
            function_calling.eval_file(args, tmp_path, suite, "ours"))


def test_the_call_threshold_and_the_base_template_reach_the_judge(bench, tmp_path, monkeypatch):
    _, function_calling = bench
    seen = []

    def evaluate_artifacts(tasks, artifacts, **settings):
        seen.append((settings["call_threshold"], settings["chat_template"]))
        return {"artifacts": [{"results": []}]}

    monkeypatch.setattr(function_calling, "evaluate_artifacts", evaluate_artifacts)
    for given, expected in ((["--call-threshold", "0.5"], 0.5), ([], None)):
        args = function_calling.parse_args(["--work", str(tmp_path), "--base-chat-template", "chatml", *given])
        function_calling.judged(args, tmp_path, "bfcl", "ours", tmp_path / "model.gguf")
        assert seen[-1] == (expected, None)  # a tuned arm keeps the template it was exported with
        function_calling.judged(args, tmp_path, "bfcl", "base", tmp_path / "base.gguf")
        assert seen[-1] == (expected, "chatml")


def test_auto_judges_each_arm_with_its_own_threshold_chosen_on_training_rows(bench, tmp_path, monkeypatch):
    _, function_calling = bench
    judged_with, chosen_on = {}, []

    def choose_call_threshold(tasks, artifact, limit=None, threads=None, chat_template=None):
        chosen_on.append((Path(tasks).name, limit, chat_template))
        return {"threshold": 0.61 if Path(artifact).stem == "ours" else 0.42}

    def evaluate_artifacts(tasks, artifacts, **settings):
        judged_with[Path(artifacts[0]).stem] = settings["call_threshold"]
        return {"artifacts": [{"results": []}]}

    monkeypatch.setattr(function_calling, "choose_call_threshold", choose_call_threshold)
    monkeypatch.setattr(function_calling, "evaluate_artifacts", evaluate_artifacts)
    args = function_calling.parse_args(["--work", str(tmp_path), "--call-threshold", "auto", "--calibration-rows",
                                        "50", "--base-chat-template", "chatml"])
    for name in ("ours", "base"):
        for suite in ("heldout", "bfcl"):
            function_calling.judged(args, tmp_path, suite, name, tmp_path / f"{name}.gguf")
    assert judged_with == {"ours": 0.61, "base": 0.42}
    assert chosen_on == [("train.jsonl", 50, None), ("train.jsonl", 50, "chatml")]  # once per arm, then kept
    fixed = function_calling.parse_args(["--work", str(tmp_path), "--call-threshold", "0.5"])
    assert function_calling.eval_file(args, tmp_path, "bfcl", "ours") != function_calling.eval_file(
        fixed, tmp_path, "bfcl", "ours")


def test_memory_flags_reach_our_rl_recipe(bench, tmp_path):
    """--micro-batch-size and --gradient-checkpointing set ours' update (the SFT recipes carry them unused)."""
    _, function_calling = bench
    plain = function_calling.recipes(function_calling.parse_args(["--work", str(tmp_path), "--model", "bundled"]),
                                     tmp_path)["small"]
    saving = function_calling.parse_args(["--work", str(tmp_path), "--model", "bundled", "--micro-batch-size", "4",
                                          "--gradient-checkpointing"])
    small = function_calling.recipes(saving, tmp_path)["small"]
    assert (plain.rl.micro_batch_size, plain.compute.gradient_checkpointing) == (8, False)  # the defaults
    assert (small.rl.micro_batch_size, small.compute.gradient_checkpointing) == (4, True)
    assert small.rl.minibatch_size == 4 * 8  # prompts x group: the minibatch it cuts


def test_twins_reach_the_task_step_and_a_work_dir_of_the_other_setting_is_refused(bench, tmp_path):
    """``--twins`` writes training rows with twins (held-out rows as without), is recorded in the settings, and a
    rerun on a work directory written with the other setting stops instead of training on the wrong rows."""
    _, function_calling = bench
    args = function_calling.parse_args(["--work", str(tmp_path / "twins"), "--twins"])
    assert args.twins and not function_calling.parse_args(["--work", str(tmp_path)]).twins
    sizes = AgentSizes(train_tasks=40, heldout_tasks=10, demonstrations=10)
    for name, twins in (("twins", True), ("plain", False)):
        function_calling.check_tasks(tmp_path / name, twins)
        tasks_step(tmp_path / name, sizes, print, mix=DEFAULT_MIX, twins=twins)
    train = {name: (tmp_path / name / "tasks" / "train.jsonl").read_text() for name in ("twins", "plain")}
    assert "_multiple_twin_" in train["twins"] and "_multiple_twin_" not in train["plain"]
    heldout = [(tmp_path / name / "tasks" / "heldout.jsonl").read_bytes() for name in ("twins", "plain")]
    assert heldout[0] == heldout[1]
    with pytest.raises(SystemExit, match="without --twins"):
        function_calling.check_tasks(tmp_path / "plain", True)
    with pytest.raises(SystemExit, match="with --twins"):
        function_calling.check_tasks(tmp_path / "twins", False)


def test_the_task_step_names_the_categories_it_writes(tmp_path):
    """The first progress line names the categories of the mix the rows are written with: the quickstart's three, or
    all five of the benchmark's, and the rows hold exactly those."""
    sizes = AgentSizes(train_tasks=40, heldout_tasks=10, demonstrations=10)
    for name, mix, named in (("quickstart", None, "(simple, parallel, irrelevance)"),
                             ("bench", DEFAULT_MIX, "(simple, multiple, parallel, parallel_multiple, irrelevance)")):
        lines = []
        tasks_step(tmp_path / name, sizes, lines.append, mix=mix)
        assert named in lines[0]
        rows = [json.loads(line) for line in (tmp_path / name / "tasks" / "train.jsonl").read_text().splitlines()]
        assert ", ".join(sorted({row["category"] for row in rows})) == ", ".join(sorted(named[1:-1].split(", ")))


def test_the_rl_learning_rate_flag_reaches_ours_and_trls_recipe_only(bench, tmp_path):
    """``--rl-learning-rate`` sets the RL stage's rate of the recipe ours and TRL train from; without it the
    quickstart's 3e-4 stands, and SFT's rate is not touched either way."""
    _, function_calling = bench
    given = function_calling.parse_args(["--work", str(tmp_path), "--model", "bundled", "--rl-learning-rate", "1e-4"])
    default = function_calling.parse_args(["--work", str(tmp_path), "--model", "bundled"])
    small, plain = (function_calling.recipes(args, tmp_path)["small"] for args in (given, default))
    assert (small.rl.learning_rate, plain.rl.learning_rate) == (1e-4, 3e-4)
    assert small.sft.learning_rate == plain.sft.learning_rate


def test_trls_config_takes_ours_budget_and_warmup_in_optimizer_steps(bench, tmp_path):
    """TRL's GRPOConfig samples ours' replies an iteration and takes ours' optimizer steps; ours' warmup of 2
    iterations at 2 epochs an iteration is TRL's 4 warmup steps, and TRL's rate climbs through them to the full rate.
    Without ``rl.warmup_steps`` TRL starts at the full rate."""
    from transformers import get_scheduler

    agent_tasks, function_calling = bench
    argv = ["--work", str(tmp_path), "--model", "bundled", "--rl-steps", "5"]
    warm = function_calling.parse_args([*argv, "--rl-set", "rl.warmup_steps=2", "--rl-set", "rl.epochs=2"])
    plain = function_calling.parse_args([*argv, "--rl-set", "rl.epochs=2"])
    warm_recipe, plain_recipe = (function_calling.recipes(args, tmp_path)["small"] for args in (warm, plain))
    rl = warm_recipe.rl
    config = agent_tasks.trl_grpo_config(warm_recipe, tmp_path / "trl-out", 3e-4)
    updates = rl.prompts_per_step * rl.group_size * 2 // rl.minibatch_size
    assert config.per_device_train_batch_size * config.steps_per_generation == rl.prompts_per_step * rl.group_size
    assert (config.num_iterations, config.max_steps, config.warmup_steps) == (2, 5 * updates, 2 * updates)
    assert config.warmup_steps == 4
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=config.learning_rate)
    schedule = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.warmup_steps,
                             num_training_steps=config.max_steps)
    rates = []
    for _ in range(config.max_steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert rates[:5] == pytest.approx([0.0, 0.75e-4, 1.5e-4, 2.25e-4, 3e-4])
    assert agent_tasks.trl_grpo_config(plain_recipe, tmp_path / "trl-out", 3e-4).warmup_steps == 0


def test_sft_micro_batches_keep_sfts_step_of_eight_chats(bench, tmp_path):
    """``--sft-micro-batch 2`` forwards 2 chats at a time and accumulates 4 passes: SFT-small's and SFT-all's step
    stays 8 chats (their other settings as without the flag); a size that does not divide the step is refused."""
    _, function_calling = bench
    argv = ["--work", str(tmp_path), "--model", "bundled"]
    plain = function_calling.recipes(function_calling.parse_args(argv), tmp_path)
    split = function_calling.recipes(function_calling.parse_args([*argv, "--sft-micro-batch", "2"]), tmp_path)
    for name in ("small", "all"):
        assert (plain[name].sft.batch_size, plain[name].sft.grad_accum) == (8, 1)
        assert (split[name].sft.batch_size, split[name].sft.grad_accum) == (2, 4)
        assert split[name].sft.max_steps == plain[name].sft.max_steps
        assert split[name].data == plain[name].data
    with pytest.raises(SystemExit, match="--sft-micro-batch 3: choose a divisor of SFT's step of 8 chats"):
        function_calling.recipes(function_calling.parse_args([*argv, "--sft-micro-batch", "3"]), tmp_path)
