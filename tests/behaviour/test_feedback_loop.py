"""The loop, closed on the bundled model: 45 recorded turns with edits, picks and thumbs -> feedback
export -> DPO and KTO -> export -> the new artifacts, run in the runtime, prefer the chosen answers
of held-out pairs more often than the artifact the feedback was given to
(benchmarks/feedback_loop.py drives it)."""

import importlib.util
import json
from pathlib import Path

import pytest

from slm_align.stats import wilson_interval

LOOP = Path(__file__).resolve().parents[2] / "benchmarks" / "feedback_loop.py"


def loop_module():
    spec = importlib.util.spec_from_file_location("feedback_loop", LOOP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_feedback_trains_dpo_and_kto_whose_exports_prefer_the_chosen_answers(tmp_path):
    pytest.importorskip("llama_cpp")
    result = loop_module().close_the_loop(tmp_path, turns=45, steps=30, learning_rate=5e-3, sft_steps=5)
    assert result["feedback"] == {"edit": 15, "choice": 15, "down": 15}
    assert result["exported"]["pairs"] == 30 and result["exported"]["unpaired"] == 15
    shares = result["runtime_preference"]
    assert shares["sft"]["pairs"] >= 4
    for name in ("sft", "dpo", "kto"):  # the runtime's share with its 95% Wilson interval, for every artifact
        low, high = shares[name]["ci95"]
        assert 0.0 <= low < high <= 1.0 and low <= shares[name]["share"] <= high
        assert (low, high) == wilson_interval(shares[name]["wins"], shares[name]["pairs"])
    for algo in ("dpo", "kto"):
        assert shares[algo]["share"] > shares["sft"]["share"]
        assert shares[algo]["share"] >= 0.75
        record = result["rounds"][algo]["feedback_models"]
        assert record["foreign"] == [] and len(record["matched"]) == 1  # the feedback was given to this run's model
    rows = [json.loads(line) for line in (tmp_path / "prefs.jsonl").read_text().splitlines()]
    assert {row["model_id"] for row in rows} == set(record["matched"])
    for algo in ("dpo", "kto"):  # each export's model card names the round it folds in, with its figures
        card = (tmp_path / f"export-{algo}" / "README.md").read_text()
        accuracy = result["rounds"][algo]["heldout_accuracy"]["value"]
        low, high = result["rounds"][algo]["heldout_accuracy"]["ci95"]  # the round's held-out figure, its interval
        assert 0.0 <= low <= accuracy <= high <= 1.0
        assert f"- {algo.upper()}: 30 steps" in card and f"-> {accuracy:.3f}" in card
        assert f"- \"{algo}\"" in card.split("---")[1]  # a tag in the YAML header


