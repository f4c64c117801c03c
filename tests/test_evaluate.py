"""The evaluation report's logic (slm_align.evaluate.stage) without a model: the comparison's verdict from its
interval, which policies a run holds, the preference records, and the report's words; the measurement runs
end to end in tests/cli/test_commands.py."""

from __future__ import annotations

import json
from pathlib import Path

import slm_align.evaluate.stage as evaluate
from slm_align.config import load_recipe
from slm_align.evaluate.stage import (
    compare,
    preference_records,
    preference_section,
    render_markdown,
    run_policies,
    summary_line,
)
from slm_align.runs import MANIFEST


def row(name: str, rewards: list[float]) -> dict:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return {"name": name, "model": name, "ppl": 9.5, "reward_mean": mean, "reward_std": std, "distinct_1": 0.5,
            "distinct_2": 0.75, "length": 12.0, "truncated_frac": 0.25, "rewards": rewards,
            "completions": [f"{name} answer {i} " + "x" * 400 for i in range(len(rewards))]}


def test_a_comparison_calls_a_change_significant_only_when_its_interval_leaves_zero():
    sft = row("sft", [0.0, 0.25, 0.5, 0.25] * 10)
    better = compare(sft, row("rl", [0.5, 0.75, 1.0, 0.75] * 10), seed=0)
    assert (better["delta"], better["win_rate"], better["verdict"]) == (0.5, 1.0, "significant gain")
    assert better["delta_ci95"] == (0.5, 0.5) and better["baseline"] == "sft" and better["policy"] == "rl"
    worse = compare(sft, row("kto", [0.0, 0.0, 0.25, 0.0] * 10), seed=0)
    assert worse["verdict"] == "significant drop" and worse["delta"] == -0.1875
    mixed = compare(sft, row("dpo", [0.25, 0.0, 0.25, 0.5] * 10), seed=0)  # swaps: same mean
    assert mixed["delta"] == 0.0 and mixed["win_rate"] == 0.5 and mixed["verdict"] == "no significant change"
    assert mixed["delta_ci95"][0] < 0 < mixed["delta_ci95"][1]


def finished(stage_dir: Path, metrics: dict, inputs: dict | None = None, adapter: bool = False) -> None:
    stage_dir.mkdir(parents=True)
    (stage_dir / MANIFEST).write_text(json.dumps({"inputs_hash": "x", "inputs": inputs or {}, "metrics": metrics}))
    if adapter:
        (stage_dir / "adapter").mkdir()


def test_the_prior_is_the_sft_adapter_unless_rl_started_from_the_model_as_given(tmp_path):
    recipe = load_recipe()
    assert evaluate._starts_from_sft(recipe, tmp_path, tmp_path / "other")  # --sft names it
    assert not evaluate._starts_from_sft(load_recipe(overrides={"rl.from_sft": False}), tmp_path, None)
    assert evaluate._starts_from_sft(recipe, tmp_path, None)  # nothing finished yet: RL will train SFT first
    finished(tmp_path / "rl", {}, inputs={"sft": None})
    assert not evaluate._starts_from_sft(recipe, tmp_path, None)  # RL recorded no SFT prior
    finished(tmp_path / "sft", {})
    assert evaluate._starts_from_sft(recipe, tmp_path, None)


def test_a_run_holds_its_prior_then_each_aligned_stage_then_the_baselines(monkeypatch, tmp_path):
    checked = []
    monkeypatch.setattr(evaluate, "require_adapter", lambda directory, allow_pickle: checked.append(directory))
    finished(tmp_path / "kto", {}, adapter=True)
    finished(tmp_path / "rl", {}, adapter=True)
    sft_adapter = tmp_path / "sft" / "adapter"
    policies = run_policies(load_recipe(), tmp_path, sft_adapter, ["gpt2"])
    assert [p.name for p in policies] == ["sft", "rl", "kto", "gpt2"]  # ALIGNED_STAGES' order, baselines last
    assert [p.describe for p in policies[1:3]] == ["sft + RL adapter", "sft + KTO adapter"]
    assert checked == [sft_adapter, tmp_path / "rl" / "adapter", tmp_path / "kto" / "adapter"]  # all before loading
    from_base = run_policies(load_recipe(), tmp_path, None, [])
    assert [p.name for p in from_base] == ["base", "rl", "kto"] and from_base[0].describe.endswith("as given")


def test_preference_stages_report_their_held_out_accuracy_before_and_after(tmp_path):
    headline = {"kind": "pair_accuracy", "value": 0.75, "ci95": [0.6, 0.86]}
    finished(tmp_path / "dpo", {"heldout_accuracy": headline, "heldout_before": {"pair_accuracy": 0.0},
                                "steps": 40, "heldout_pairs": 32})
    finished(tmp_path / "kto", {"heldout_accuracy": None})  # measured nothing: left out
    records = preference_records(tmp_path)
    assert records == [{"stage": "dpo", "kind": "pair_accuracy", "before": 0.0, "after": 0.75, "ci95": [0.6, 0.86],
                        "steps": 40, "heldout_pairs": 32}]
    assert "| dpo (pair accuracy) | 0.000 | 0.750 | [0.600, 0.860] | 32 | 40 |" in preference_section(records)
    assert preference_section([]) == []


def test_the_report_reads_its_figures_and_its_comparisons():
    sft = row("sft", [0.0, 0.5])
    rl = row("rl", [1.0, 0.5])
    comparison = compare(sft, rl, seed=0)
    report = {"prompts": 2, "temperature": 0.7, "max_new_tokens": 32, "seed": 5, "reward_terms": ["exact_answer"],
              "policies": [sft, rl], "comparisons": [comparison],
              "samples": [{"prompt": "2+2?", "sft": sft["completions"][0], "rl": rl["completions"][0]}]}
    text = render_markdown(report, has_curves=False)
    assert "2 held-out prompts, one sample each, temperature 0.7, 32 new tokens, seed 5; reward: exact_answer." in text
    assert "| rl | 9.500 | 0.750 | 0.250 | 0.500 | 0.750 | 12.0 | 25.0% |" in text
    assert f"- {summary_line(comparison)}" in text and "training_curves.png" not in text
    assert f"- *rl*: {rl['completions'][0][:300]}\n" in text  # a sample cut at 300 characters
    assert "training_curves.png" in render_markdown(report, has_curves=True)
    assert summary_line(comparison) == ("rl vs sft: reward delta +0.500 [95% CI +0.000, +1.000], win rate 75.0% "
                                        "[50.0%, 100.0%] (analytical 92.1%), p = 1: no significant change")
