"""The figures of the quickstart's transcript in README.md, and the same figures of a run's ``--json``, each as
the text the quickstart prints (so "0.240" in the README equals a run's 0.24): the test of the README holds
one to the other."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
ARTIFACTS = ("base", "SFT", "RL")
DIFFERENCES = ("SFT - base", "RL - SFT")
NUMBER = r"[+-]?\d+\.\d+"


def transcript(readme: Path = README) -> str:
    """The console block under the README's Quickstart heading, its wrapped lines joined by single spaces."""
    text = readme.read_text(encoding="utf-8")
    section = text.split("\n## Quickstart\n", 1)[1]
    block = section.split("```console\n", 1)[1].split("\n```", 1)[0]
    return " ".join(block.split())


def _found(pattern: str, text: str, what: str) -> re.Match:
    match = re.search(pattern, text)
    if match is None:
        raise AssertionError(f"the README's quickstart transcript has no {what} line ({pattern})")
    return match


def readme_figures(readme: Path = README) -> dict[str, str]:
    """Every figure the README's transcript prints, keyed by what it is."""
    text = transcript(readme)
    figures = {}
    loss = _found(rf"train loss ({NUMBER}), eval loss ({NUMBER})", text, "SFT loss")
    figures["sft train loss"], figures["sft eval loss"] = loss.groups()
    figures["gate"] = _found(r"gate: (PASS|FAIL)", text, "gate").group(1)
    check = _found(rf"SFT ({NUMBER}) -> RL ({NUMBER}); exported", text, "RL check")
    figures["rl check sft"], figures["rl check rl"] = check.groups()
    for name in ARTIFACTS:
        row = _found(rf" {name}: success ({NUMBER}) \[95% CI ({NUMBER}), ({NUMBER})\] \(([^)]*)\); call rate "
                     rf"({NUMBER})", text, f"{name} success")
        success, low, high, categories, calls = row.groups()
        figures.update({f"{name} success": success, f"{name} ci": f"{low}, {high}", f"{name} call rate": calls,
                        f"{name} categories": categories})
    for name in DIFFERENCES:
        row = _found(rf" {name}: ({NUMBER}) \[95% CI ({NUMBER}), ({NUMBER})\] \(paired bootstrap over rows\): "
                     r"(gain|loss|no gain)", text, name)
        delta, low, high, verdict = row.groups()
        figures.update({f"{name} delta": delta, f"{name} ci": f"{low}, {high}", f"{name} verdict": verdict})
    return figures


def run_figures(result: dict) -> dict[str, str]:
    """The same figures from a quickstart's ``--json`` result, formatted as the quickstart prints them."""
    sft = result["sft"]["metrics"]
    rl = result["rl"]["metrics"]
    figures = {"sft train loss": f"{sft['train_loss']:.3f}", "sft eval loss": f"{sft['eval_loss']:.3f}",
               "gate": result["rl"]["gate"], "rl check sft": f"{rl['heldout_reward_sft']:.3f}",
               "rl check rl": f"{rl['heldout_reward_rl']:.3f}"}
    evaluation = result["evaluation"]
    for name in ARTIFACTS:
        row = evaluation["artifacts"][name]
        low, high = row["success_ci95"]
        categories = ", ".join(f"{group} {f['accuracy']:.2f}" for group, f in row["by_category"].items())
        figures.update({f"{name} success": f"{row['success_rate']:.3f}", f"{name} ci": f"{low:.3f}, {high:.3f}",
                        f"{name} call rate": f"{row['call_rate']:.2f}", f"{name} categories": categories})
    for name in DIFFERENCES:
        found = evaluation["differences"][name]
        low, high = found["ci95"]
        verdict = "gain" if low > 0 else "loss" if high < 0 else "no gain"
        figures.update({f"{name} delta": f"{found['success_delta']:+.3f}", f"{name} ci": f"{low:+.3f}, {high:+.3f}",
                        f"{name} verdict": verdict})
    return figures
