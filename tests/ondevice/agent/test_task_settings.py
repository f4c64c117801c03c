"""How evaluation episodes run, as one object: its bounds refused in one line naming the flag, the
report's account of it, and ``evaluate_artifacts`` taking it or its fields by name."""

from __future__ import annotations

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent import task_eval
from slm_align.ondevice.agent.task_settings import INTERVALS, EpisodeSettings


@pytest.mark.parametrize("field, value, flag", [
    ("samples", 0, "--samples"), ("temperature", 2.5, "--temperature"), ("temperature", True, "--temperature"),
    ("max_tool_rounds", -1, "--max-tool-rounds"), ("max_tokens", 0, "--max-new-tokens"), ("batch", 0, "--batch"),
    ("call_threshold", 1.5, "--call-threshold"), ("call_threshold", -0.1, "--call-threshold")])
def test_a_setting_out_of_bounds_is_refused_naming_its_flag(field, value, flag):
    with pytest.raises(UserError, match=f"^{flag} must be"):
        EpisodeSettings(**{field: value}).check()


def test_the_report_says_greedy_with_temperature_0_or_sampled_with_its_own():
    assert EpisodeSettings(temperature=0.9, seed=3).report() == {
        "samples": 1, "decoding": "greedy", "temperature": 0.0, "seed": 3, "call_threshold": None,
        "chat_template": None, "intervals": INTERVALS}
    assert EpisodeSettings(samples=4, temperature=0.9).report()["temperature"] == 0.9


def recording_open_agent(monkeypatch) -> list:
    """Replace the artifact loading with a record of how each agent would be opened, then stop."""
    opened = []

    def open_agent(artifact, max_tokens, max_tool_rounds, threads, call_threshold, chat_template):
        opened.append((artifact, max_tokens, max_tool_rounds, threads, call_threshold, chat_template))
        raise KeyboardInterrupt  # nothing runs past the opening

    monkeypatch.setattr(task_eval, "open_agent", open_agent)
    monkeypatch.setattr(task_eval, "task_rows", lambda tasks, bfcl, limit: ([{"prompt": "q"}], "t"))
    return opened


def test_evaluate_artifacts_takes_the_object_or_its_fields_by_name(monkeypatch):
    opened = recording_open_agent(monkeypatch)
    for call in ({"settings": EpisodeSettings(max_tokens=12, max_tool_rounds=0, threads=2, call_threshold=0.5)},
                 {"max_tokens": 12, "max_tool_rounds": 0, "threads": 2, "call_threshold": 0.5},
                 {"settings": EpisodeSettings(max_tokens=5), "max_tokens": 12, "max_tool_rounds": 0,
                  "threads": 2, "call_threshold": 0.5}):
        with pytest.raises(KeyboardInterrupt):
            task_eval.evaluate_artifacts("tasks.jsonl", ["model.gguf"], **call)
    assert opened == [("model.gguf", 12, 0, 2, 0.5, None)] * 3


def test_evaluate_artifacts_refuses_an_unknown_keyword_and_a_bad_setting_before_opening(monkeypatch):
    opened = recording_open_agent(monkeypatch)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_tokens'"):
        task_eval.evaluate_artifacts("tasks.jsonl", ["model.gguf"], max_new_tokens=12)
    with pytest.raises(UserError, match="--samples must be"):
        task_eval.evaluate_artifacts("tasks.jsonl", ["model.gguf"], samples=0)
    assert opened == []
