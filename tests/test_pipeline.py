"""The pipeline (slm_align.pipeline): what train chains for each stage and algorithm, what it runs first when
a stage it needs is missing, and what it refuses; the stages themselves are stand-ins that record their calls
(the stages are tested in their own files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slm_align.pipeline as pipeline
from slm_align.config import load_recipe
from slm_align.envelope.gate import GateRefused
from slm_align.errors import UserError
from slm_align.runs import MANIFEST, StageResult


class Calls:
    """Stand-ins for the stages: each records (name, out) and returns a result."""

    def __init__(self, monkeypatch, metrics: dict | None = None):
        self.made: list[tuple[str, Path]] = []
        self.metrics = metrics or {}
        for name in ("run_sft", "run_reward", "run_rl", "run_preference"):
            monkeypatch.setattr(pipeline, name, self.stand_in(name))
        monkeypatch.setattr(pipeline, "evaluate", self.evaluate)

    def stand_in(self, name: str):
        def run(recipe, out, **kwargs):
            self.made.append((name, Path(out)))
            return StageResult(Path(out) / name, skipped=False, metrics=self.metrics)

        return run

    def evaluate(self, recipe, out, **kwargs):
        self.made.append(("evaluate", Path(out)))
        return {"prompts": kwargs["prompts"]}


def finished(stage_dir: Path) -> Path:
    """A stage folder with a manifest (no files listed), as read_manifest accepts it."""
    stage_dir.mkdir(parents=True)
    (stage_dir / MANIFEST).write_text(json.dumps({"inputs_hash": "x", "metrics": {}}))
    return stage_dir


def said() -> tuple[list[str], object]:
    lines: list[str] = []
    return lines, lines.append


def test_train_runs_the_stage_asked_for(monkeypatch, tmp_path):
    calls = Calls(monkeypatch)
    recipe = load_recipe()
    assert pipeline.train(recipe, tmp_path, "sft").result.stage_dir == tmp_path / "run_sft"
    pipeline.train(recipe, tmp_path, "reward")
    dpo = load_recipe(overrides={"rl.algo": "dpo"})
    trained = pipeline.train(dpo, tmp_path, "rl")
    assert [name for name, _ in calls.made] == ["run_sft", "run_reward", "run_preference"]
    assert trained.evaluation is None  # DPO/KTO report their own held-out accuracy
    with pytest.raises(UserError, match="--stage ppo: choose sft, reward or rl"):
        pipeline.train(recipe, tmp_path, "ppo")


def test_rl_is_followed_by_the_evaluation_unless_it_trained_an_agent_or_none_is_asked(monkeypatch, tmp_path):
    calls = Calls(monkeypatch)
    trained = pipeline.train(load_recipe(overrides={"rl.report_prompts": 7}), tmp_path, "rl")
    assert [name for name, _ in calls.made] == ["run_rl", "evaluate"] and trained.evaluation == {"prompts": 7}
    calls.made.clear()
    assert pipeline.train(load_recipe(overrides={"rl.report_prompts": 0}), tmp_path, "rl").evaluation is None
    calls.metrics = {"episodes": True}  # agent episodes: judged by evaluate-agent after export
    assert pipeline.train(load_recipe(), tmp_path, "rl").evaluation is None
    assert [name for name, _ in calls.made] == ["run_rl", "run_rl"]


def test_sft_runs_first_when_the_run_has_none_and_another_runs_sft_must_be_finished(monkeypatch, tmp_path):
    calls = Calls(monkeypatch)
    monkeypatch.setattr(pipeline, "recipe_from_sft", lambda run, recipe: (recipe, Path(run) / "sft" / "adapter"))
    lines, say = said()
    recipe, adapter = pipeline.sft_prior(load_recipe(), tmp_path, None, False, say)
    assert calls.made == [("run_sft", tmp_path)] and adapter == tmp_path / "sft" / "adapter"
    assert lines == ["running SFT first (no sft/ in the run)"]
    with pytest.raises(UserError, match="--sft .* has no finished SFT stage"):
        pipeline.sft_prior(load_recipe(), tmp_path / "run", tmp_path / "other", False, say)
    finished(tmp_path / "other" / "sft")
    calls.made.clear()
    assert pipeline.sft_prior(load_recipe(), tmp_path / "run", tmp_path / "other", False, say)[1] == (
        tmp_path / "other" / "sft" / "adapter") and calls.made == []


def test_the_reward_model_is_the_one_given_none_for_functions_alone_else_the_runs(monkeypatch, tmp_path):
    calls = Calls(monkeypatch)
    lines, say = said()
    recipe = load_recipe()
    given = tmp_path / "rm"
    assert pipeline.reward_model_of(recipe, tmp_path, None, given, (), False, say) == given
    assert pipeline.reward_model_of(recipe, tmp_path, None, None, ("exact_answer",), False, say) is None
    assert calls.made == []
    with pytest.raises(UserError, match="no reward: pass --reward-model or --reward"):
        pipeline.reward_model_of(recipe, tmp_path, tmp_path / "other", None, (), False, say)
    assert pipeline.reward_model_of(recipe, tmp_path, None, None, (), False, say) == tmp_path / "reward" / "model"
    assert calls.made == [("run_reward", tmp_path)]
    assert lines == ["training the reward model first (no reward/ in the run)"]


def gate_report(passed: bool, recommendation: dict | None = None) -> dict:
    info = {} if recommendation is None else {"recommendation": recommendation}
    return {"verdict": "PASS" if passed else "FAIL", "passed": passed, "info": info, "figures": [],
            "reasons": [] if passed else ["held-out perplexity 31 is not < 20"],
            "remedies": [] if passed else ["train SFT longer"]}


def test_the_gate_reuses_a_report_measured_with_these_inputs_and_refuses_a_fail(monkeypatch, tmp_path):
    measured = []
    monkeypatch.setattr(pipeline, "reusable_report", lambda *args: gate_report(True))
    monkeypatch.setattr(pipeline, "check_headroom", lambda *args, **kwargs: measured.append(1))
    lines, say = said()
    assert pipeline.gate(load_recipe(), tmp_path, None, None, (), False, say)["passed"] and measured == []
    assert lines == [f"headroom gate: PASS (reused {tmp_path / 'headroom.json'}, measured with these inputs)"]
    monkeypatch.setattr(pipeline, "reusable_report", lambda *args: gate_report(False))
    with pytest.raises(GateRefused, match=r"^headroom gate FAIL \(held-out perplexity 31 is not < 20\): Train SFT "):
        pipeline.gate(load_recipe(), tmp_path, None, None, (), False, say)
    assert pipeline.gate(load_recipe(), tmp_path, None, None, (), True, say)["passed"] is False  # --force


def test_a_new_gate_measurement_is_recorded_in_the_run(monkeypatch, tmp_path):
    class Report:
        def to_dict(self):
            return gate_report(True)

    recorded = []
    monkeypatch.setattr(pipeline, "reusable_report", lambda *args: None)
    monkeypatch.setattr(pipeline, "check_headroom", lambda *args, **kwargs: Report())
    monkeypatch.setattr(pipeline, "record_report", lambda report, recipe, out, *rest: recorded.append((report, out)))
    pipeline.gate(load_recipe(), tmp_path, None, None, ("exact_answer",), False)
    assert recorded == [(gate_report(True), tmp_path)]


def test_algo_auto_follows_the_gates_advice_and_says_why(tmp_path):
    lines, say = said()
    advice = {"algo": "grpo", "why": "within-prompt spread 0.31: GRPO"}
    chosen = pipeline.resolve_algorithm(load_recipe(overrides={"rl.algo": "auto"}), gate_report(True, advice), say)
    assert chosen.rl.algo == "grpo" and lines == ["gate advice: within-prompt spread 0.31: GRPO"]
    for algo, other in (("ppo", "grpo"), ("grpo", "ppo")):  # a chosen algorithm stays, whatever the advice
        kept = pipeline.resolve_algorithm(load_recipe(overrides={"rl.algo": algo}),
                                          gate_report(True, dict(advice, algo=other)), say)
        assert kept.rl.algo == algo
    with pytest.raises(UserError, match="--algo auto follows the gate's advice"):
        pipeline.resolve_algorithm(load_recipe(overrides={"rl.algo": "auto"}), gate_report(True), say)


def test_rl_refuses_preference_algorithms_before_any_stage(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(pipeline, "run_stage", lambda *args: ran.append(args))
    monkeypatch.setattr(pipeline, "run_sft", lambda *args, **kwargs: ran.append(args))
    with pytest.raises(UserError, match="--algo kto is preference optimisation, not RL"):
        pipeline.run_rl(load_recipe(overrides={"rl.algo": "kto"}), tmp_path)
    assert ran == [] and not any(tmp_path.iterdir())


def test_rl_without_the_sft_prior_needs_a_reward(tmp_path):
    recipe = load_recipe(overrides={"rl.from_sft": False})
    with pytest.raises(UserError, match="--no-sft starts RL from the model as given"):
        pipeline.rl_prior(recipe, tmp_path, pipeline.RLRequest(), world=None, say=print)
    assert not any(tmp_path.iterdir())


def test_a_data_parallel_launch_names_the_stage_to_run_first(tmp_path):
    with pytest.raises(UserError, match=r"needs the sft and reward stage .* run `slm-align train --stage sft"):
        pipeline.check_finished_before_launch(tmp_path, None, needs_reward_model=True)
    finished(tmp_path / "sft")
    with pytest.raises(UserError, match=r"needs the reward stage .* --stage reward"):
        pipeline.check_finished_before_launch(tmp_path, None, needs_reward_model=True)
    pipeline.check_finished_before_launch(tmp_path, None, needs_reward_model=False)


def test_which_stages_take_their_corpus_from_the_sft_stage(tmp_path):
    recipe = load_recipe()
    assert pipeline.data_from_run(recipe, "reward", tmp_path, None)
    assert pipeline.data_from_run(recipe, "sft", tmp_path, tmp_path / "other")
    assert not pipeline.data_from_run(recipe, "rl", tmp_path, None)  # no SFT yet: RL's SFT reads --data
    finished(tmp_path / "sft")
    assert pipeline.data_from_run(recipe, "rl", tmp_path, None)
    assert not pipeline.data_from_run(load_recipe(overrides={"rl.from_sft": False}), "rl", tmp_path, None)


def test_export_once_asks_for_reuse_and_reports_a_reused_artifact_as_skipped(monkeypatch, tmp_path):
    """export_once exports into ``run/export`` with reuse by inputs hash (the publish skeleton decides) and
    reports a reused artifact as skipped, a new one as the export's summary."""
    calls = []
    reused = {"value": True}

    def fake_export(request, reuse=False):
        calls.append((request, reuse))
        return StageResult(Path(request.out) / "model-Q8_0.gguf", reused["value"], {"agreement": 0.97})

    monkeypatch.setattr(pipeline, "run_export", fake_export)
    out = tmp_path / "export"
    assert pipeline.export_once(tmp_path, "gguf", "Q8_0") == {
        "dir": str(out / "model-Q8_0.gguf"), "skipped": True, "metrics": {"agreement": 0.97}}
    request, reuse = calls[0]
    assert reuse is True and request.overwrite is True and Path(request.out) == out
    assert (request.target, request.quant) == ("gguf", "Q8_0")
    reused["value"] = False
    assert pipeline.export_once(tmp_path, "gguf", "Q8_0")["skipped"] is False
