"""The headroom gate's logic (slm_align.headroom.stage) without a model: a figure's verdict at its threshold, the
report's reasons and remedies, which policy and reward model the gate judges, what identifies a measurement
(reused only with the same inputs) and what train's record asks check-headroom --run to measure again.
The measurement itself runs in tests/headroom/test_verdicts.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import slm_align.headroom.stage as headroom
from slm_align.config import load_recipe
from slm_align.envelope.gate import Figure, HeadroomReport, sentence
from slm_align.errors import UserError
from slm_align.headroom.stage import REPORT, aligned_adapter, as_recorded, gate_inputs, gate_request, gate_subject
from slm_align.runs import MANIFEST, digest


def test_a_figure_passes_strictly_below_or_at_least_its_threshold():
    assert Figure("ppl", 19.99, 20.0, "<", "r").passed and not Figure("ppl", 20.0, 20.0, "<", "r").passed
    assert Figure("acc", 0.6, 0.6, ">=", "r").passed and not Figure("acc", 0.5999, 0.6, ">=", "r").passed


def test_the_report_says_each_failure_with_its_remedy():
    report = HeadroomReport([Figure("held-out perplexity", 31.25, 20.0, "<", "train SFT longer"),
                             Figure("reward accuracy", 0.75, 0.6, ">=", "more pairs"),
                             Figure("reward spread", 0.05, 0.1, ">=", "a graded reward")], {"k": 1})
    assert (report.passed, report.verdict) == (False, "FAIL")
    as_dict = report.to_dict()
    assert as_dict["reasons"] == ["held-out perplexity 31.25 is not < 20", "reward spread 0.05 is not >= 0.1"]
    assert as_dict["remedies"] == ["train SFT longer", "a graded reward"]
    assert [f["passed"] for f in as_dict["figures"]] == [False, True, False] and as_dict["info"] == {"k": 1}
    assert report.summary() == ("FAIL, held-out perplexity 31.250 (< 20); reward accuracy 0.750 (>= 0.6); "
                                "reward spread 0.050 (>= 0.1)")
    assert HeadroomReport([Figure("ppl", 3.0, 20.0, "<", "r")]).to_dict()["verdict"] == "PASS"


def test_a_remedy_reads_as_a_sentence():
    assert sentence("  train longer ") == "Train longer."
    assert sentence("is it fluent?") == "Is it fluent?" and sentence("Stop!") == "Stop!"
    assert sentence("more samples (per prompt)") == "More samples (per prompt)."


def finished(stage_dir: Path, adapter: bool = True) -> Path:
    stage_dir.mkdir(parents=True)
    (stage_dir / MANIFEST).write_text(json.dumps({"inputs_hash": "x", "metrics": {}}))
    if adapter:
        (stage_dir / "adapter").mkdir()
    return stage_dir


def test_the_gate_judges_the_sft_prior_or_a_finished_aligned_stage(tmp_path):
    assert aligned_adapter(tmp_path, "sft") is None
    with pytest.raises(UserError, match="--stage ppo: choose sft, rl, dpo, kto"):
        aligned_adapter(tmp_path, "ppo")
    with pytest.raises(UserError, match="pass --run RUN"):
        aligned_adapter(None, "rl")
    with pytest.raises(UserError, match="has no finished dpo stage"):
        aligned_adapter(tmp_path, "dpo")
    finished(tmp_path / "dpo")
    assert aligned_adapter(tmp_path, "dpo") == tmp_path / "dpo" / "adapter"


def test_the_runs_reward_model_is_judged_unless_a_reward_is_given(monkeypatch, tmp_path):
    def from_sft(run, recipe):
        return recipe.model_copy(update={"seed": 99}), Path(run) / "sft" / "adapter"

    monkeypatch.setattr(headroom, "recipe_from_sft", from_sft)
    (tmp_path / "reward" / "model").mkdir(parents=True)
    recipe, adapter, reward_model = gate_subject(load_recipe(), tmp_path, None, None)
    assert (recipe.seed, adapter, reward_model) == (99, tmp_path / "sft" / "adapter", tmp_path / "reward" / "model")
    assert gate_subject(load_recipe(), tmp_path, None, None, ["exact_answer"])[2] is None  # --reward alone
    given = tmp_path / "elsewhere"
    assert gate_subject(load_recipe(), tmp_path, given, None)[1] == given  # an adapter given is judged as given
    no_sft = load_recipe(overrides={"rl.from_sft": False})
    assert gate_subject(no_sft, tmp_path, None, None)[0].seed == no_sft.seed


def test_a_measurement_is_identified_by_content_and_settings_not_paths(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "2+2?", "answer": "4"}\n')
    moved = tmp_path / "moved" / "tasks.jsonl"
    moved.parent.mkdir()
    shutil.copy(tasks, moved)

    def identity(**overrides):
        recipe = load_recipe(overrides={"data.tasks": str(tasks), **overrides})
        return digest(gate_inputs(recipe, None, None, None, ["exact_answer"]))

    assert identity() == identity(**{"data.tasks": str(moved)})
    assert identity() != identity(**{"headroom.max_ppl": 30.0})
    assert identity() != identity(seed=7)
    moved.write_text('{"prompt": "2+3?", "answer": "5"}\n')
    assert identity() != identity(**{"data.tasks": str(moved)})


def test_check_headroom_run_measures_what_train_recorded_under_what_the_user_gives(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    tasks = run / "tasks.jsonl"
    tasks.write_text("{}\n")
    recipe = load_recipe(overrides={"data.tasks": str(tasks), "headroom.samples_per_prompt": 8})
    request = gate_request(recipe, run, None, ["exact_answer@0.5"])
    assert request["settings"]["data.tasks"] == "tasks.jsonl"  # inside the run: moves with it
    assert request["settings"]["headroom.samples_per_prompt"] == 8 and request["rewards"] == ["exact_answer@0.5"]
    (run / REPORT).write_text(json.dumps({"verdict": "PASS", "request": request}))

    settings, rewards, model, recorded = as_recorded(run, {"headroom.max_ppl": 12.0}, [], None)
    assert settings["data.tasks"] == str(run / "tasks.jsonl") and settings["headroom.max_ppl"] == 12.0
    assert settings["headroom.samples_per_prompt"] == 8 and rewards == ["exact_answer@0.5"] and model is None
    assert recorded == request
    _, rewards, _, _ = as_recorded(run, {}, ["tool_task"], None)
    assert rewards == ["tool_task"]  # --reward replaces the recorded reward as a whole
    assert as_recorded(tmp_path, {"seed": 3}, [], None) == ({"seed": 3}, [], None, None)  # no record: the flags
