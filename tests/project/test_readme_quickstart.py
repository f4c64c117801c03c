"""The README's quickstart transcript holds every figure the quickstart prints, and they hold together: each
success inside its interval, each paired difference's words ("gain" only above zero) those of its interval.
That the figures are a fresh run's is held by the slow test in tests/behaviour/test_quickstart.py."""

import pytest

from tests.quickstart_transcript import ARTIFACTS, DIFFERENCES, readme_figures, transcript


def interval(text: str) -> tuple[float, float]:
    low, high = text.split(", ")
    return float(low), float(high)


def test_the_transcript_is_the_quickstarts_four_steps():
    text = transcript()
    assert text.startswith("$ slm-align quickstart")
    steps = [step for step in range(1, 6) if f" {step}/4 " in text]
    assert steps == [1, 2, 3, 4]


def test_every_figure_is_printed_and_the_figures_hold_together():
    figures = readme_figures()
    for name in ARTIFACTS:
        low, high = interval(figures[f"{name} ci"])
        assert low <= float(figures[f"{name} success"]) <= high
    for name in DIFFERENCES:
        low, high = interval(figures[f"{name} ci"])
        assert low <= float(figures[f"{name} delta"]) <= high
        expected = "gain" if low > 0 else "loss" if high < 0 else "no gain"
        assert figures[f"{name} verdict"] == expected


def test_a_transcript_without_the_paired_difference_is_refused(tmp_path):
    broken = tmp_path / "README.md"
    text = (transcript().replace("RL - SFT:", "RL minus SFT:"))
    broken.write_text(f"# x\n\n## Quickstart\n\n```console\n{text}\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="RL - SFT"):
        readme_figures(broken)
