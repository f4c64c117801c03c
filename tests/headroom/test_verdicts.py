"""The gate's verdicts read as sentences and say which case they see; check-headroom --run measures what
train would, never overwriting the run's record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slm_align.config import load_recipe
from slm_align.envelope.gate import GateRefused, refusal
from slm_align.headroom.stage import REMEDY_PPL, REMEDY_SPREAD
from slm_align.ondevice.rewards.spread import CASE_REMEDIES, FlatCase
from tests.helpers import finished_rl_stage, run_cli


def _failed_report() -> dict:
    return {"verdict": "FAIL", "passed": False, "info": {}, "figures": [],
            "reasons": ["held-out perplexity 31.2 is not < 20", "reward spread within prompts 0.054 is not >= 0.1"],
            "remedies": [REMEDY_PPL, REMEDY_SPREAD]}


def test_the_refusal_is_sentences_not_run_together(monkeypatch, tmp_path):
    import slm_align.pipeline

    monkeypatch.setattr(slm_align.pipeline, "reusable_report", lambda *args: _failed_report())
    with pytest.raises(GateRefused) as refused:
        slm_align.pipeline.gate(load_recipe(), tmp_path, None, None, ["task_success"], force=False)
    message = str(refused.value)
    assert message.startswith("headroom gate FAIL (held-out perplexity 31.2 is not < 20; reward spread")
    ppl, spread = (f"{remedy[0].upper()}{remedy[1:]}" for remedy in (REMEDY_PPL, REMEDY_SPREAD))
    assert f"{ppl}. {spread}. Pass --force to train anyway" in message
    assert ") Pass" not in message and "model the" not in message  # "... base model the reward ..." before
    assert slm_align.pipeline.gate(load_recipe(), tmp_path, None, None, [], force=True)["passed"] is False


@pytest.mark.parametrize("case", sorted(CASE_REMEDIES))
def test_each_spread_case_ends_its_sentence_before_the_force_advice(case):
    """The flat case's remedy ends in a parenthesis ("... more samples per prompt)"): the refusal closes it
    with a full stop before "Pass --force" ("functions) Pass --force" ran two sentences together)."""
    remedy = FlatCase(case, None, "what the gate saw").remedy
    message = refusal("headroom gate", {"reasons": ["reward spread 0 is not >= 0.1"], "remedies": [remedy]})
    assert message.endswith(f"{remedy[0].upper()}{remedy[1:].rstrip('.')}. Pass --force to train anyway "
                            "(recorded in the manifest).")


def _tasks(path: Path, n: int = 24) -> Path:
    rows = [{"prompt": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def refused_run(tmp_path_factory, tiny_models, stories):
    """A run whose train gate said FAIL (perplexity above a strict --max-ppl), measured on a task
    file with a reward function: its headroom.json is train's record."""
    from slm_align.cli import main

    root = tmp_path_factory.mktemp("refused")
    run = root / "run"
    args = ["train", "--model", tiny_models["llama"], "--data", stories, "--tasks", _tasks(root / "tasks.jsonl"),
            "--reward", "exact_answer", "--algo", "grpo", "--out", run, "--max-ppl", "1.01", "--gate-samples", "2",
            "--set", "sft.max_steps=2", "--set", "sft.batch_size=4", "--set", "data.max_length=64",
            "--set", "headroom.spread_prompts=4", "--set", "headroom.max_new_tokens=6",
            "--set", "headroom.max_documents=8"]
    with pytest.raises(SystemExit) as refused:
        main([str(arg) for arg in args])
    assert refused.value.code == 1 and not (run / "rl").exists()
    return run


def test_check_headroom_on_a_run_measures_what_train_measured_and_keeps_its_record(capsys, refused_run):
    record = (refused_run / "headroom.json").read_bytes()
    recorded = json.loads(record)
    assert recorded["verdict"] == "FAIL" and recorded["request"]["rewards"] == ["exact_answer"]
    code, stdout, _ = run_cli(capsys, "check-headroom", "--run", refused_run, "--json")
    report = json.loads(stdout)
    assert code == 1 and report["verdict"] == "FAIL"
    assert "reward" not in report["info"]  # never "reward: not measured": the run's reward was measured
    assert report["info"]["reward_terms"] == ["exact_answer"] and "tasks.jsonl" in report["info"]["prompts"]
    assert report["figures"] == recorded["figures"]  # the same prior, tasks, reward, seed and thresholds
    assert report["info"]["reward_spread"] == recorded["info"]["reward_spread"]
    assert (refused_run / "headroom.json").read_bytes() == record  # train's record is not overwritten
    code, stdout, _ = run_cli(capsys, "check-headroom", "--run", refused_run, "--max-ppl", "1e9", "--json")
    perplexity = json.loads(stdout)["figures"][0]  # a flag replaces the recorded setting
    assert perplexity["threshold"] == 1e9 and perplexity["passed"] and perplexity["value"] == recorded_ppl(record)
    code, stdout, _ = run_cli(capsys, "check-headroom", "--run", refused_run)
    said = " ".join(stdout.split())  # as rich wrapped it
    assert code == 1 and "measured as the gate of train in" in said and "all samples fail (0/4 samples" in said
    assert (refused_run / "headroom.json").read_bytes() == record


def recorded_ppl(record: bytes) -> float:
    return json.loads(record)["figures"][0]["value"]


def test_check_headroom_judges_the_rl_policy_the_same_way(capsys, refused_run):
    record = (refused_run / "headroom.json").read_bytes()
    code, _, err = run_cli(capsys, "check-headroom", "--run", refused_run, "--stage", "rl")
    assert code == 2 and err.count("\n") == 1 and "no finished rl stage" in err and "--stage sft" in err
    code, _, err = run_cli(capsys, "check-headroom", "--run", refused_run, "--stage", "ppo")
    assert code == 2 and err.count("\n") == 1 and "--stage ppo: choose sft, rl, dpo, kto" in err
    finished_rl_stage(refused_run)
    code, stdout, _ = run_cli(capsys, "check-headroom", "--run", refused_run, "--stage", "rl", "--json")
    report = json.loads(stdout)
    sft_ppl = json.loads(record)["figures"][0]["value"]
    assert report["info"]["stage"] == "rl" and report["info"]["aligned_adapter"].endswith("rl/adapter")
    assert report["info"]["prior_ppl"] == pytest.approx(sft_ppl, rel=1e-4)  # the SFT prior under the RL adapter
    assert abs(report["figures"][0]["value"] - sft_ppl) > 1e-3  # the RL policy itself is measured
    assert report["info"]["reward_terms"] == ["exact_answer"] and report["figures"][-1]["name"].startswith("reward")
    assert (refused_run / "headroom.json").read_bytes() == record
