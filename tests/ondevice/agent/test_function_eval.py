"""Function-calling task rows in evaluate-agent (agent/function_eval.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.function_eval import (
    answer_text,
    category_figures,
    check_function_row,
    function_messages,
    is_function_row,
    judge_reply,
    valid_calls,
)

TOOL = {"type": "function", "function": {"name": "alarm_set", "description": "Set an alarm.",
                                         "parameters": {"type": "object",
                                                        "properties": {"time": {"type": "string"},
                                                                       "label": {"type": "string", "default": ""}},
                                                        "required": ["time"]}}}
ROW = {"id": "f1", "category": "simple",
       "messages": [{"role": "user", "content": "Wake me at 6:30, label it gym"}],
       "tools": [TOOL], "ground_truth": [{"alarm_set": {"time": ["06:30"], "label": ["gym"]}}]}


def reply(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_is_function_row():
    """Only a dict with ground_truth (mutation: any dict, or a list crashing)."""
    assert is_function_row(ROW)
    assert not is_function_row({"messages": []})
    assert not is_function_row(["ground_truth"])


def test_function_messages_from_prompt_or_messages():
    """A text prompt becomes one user message; messages are copied (mutation: the row's dicts shared)."""
    assert function_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    messages = function_messages(ROW)
    messages[0]["content"] = "changed"
    assert ROW["messages"][0]["content"].startswith("Wake")


@pytest.mark.parametrize("row", [{"messages": []}, {"messages": [{"content": "x"}]}, {}])
def test_function_messages_refused(row):
    """No messages, or messages without roles (mutation: an empty chat accepted)."""
    with pytest.raises(UserError, match="needs 'messages'"):
        function_messages(row)


def test_check_function_row_names_where():
    """Rows without messages or tools, or with a ground truth naming an unoffered function, are
    refused naming the row (mutation: a check skipped)."""
    check_function_row("tasks.jsonl:1", ROW)
    with pytest.raises(UserError, match=r"^tasks.jsonl:2: a function task row needs 'messages'"):
        check_function_row("tasks.jsonl:2", {**ROW, "messages": None})
    with pytest.raises(UserError, match=r"^tasks.jsonl:3: a function task row needs 'tools'"):
        check_function_row("tasks.jsonl:3", {**ROW, "tools": []})
    with pytest.raises(UserError):
        check_function_row("tasks.jsonl:4", {**ROW, "ground_truth": [{"alarm_delete": {}}]})


def test_judge_reply_right_and_wrong():
    """The right call passes; a wrong value, a wrong tool, no call fail (mutation: verdict ignores values)."""
    verdict, calls = judge_reply(ROW, reply("alarm_set", '{"time": "06:30", "label": "gym"}'))
    assert verdict.ok and calls[0]["name"] == "alarm_set"
    assert not judge_reply(ROW, reply("alarm_set", '{"time": "07:30", "label": "gym"}'))[0].ok
    assert not judge_reply(ROW, reply("alarm_clear", '{"time": "06:30"}'))[0].ok
    verdict, calls = judge_reply(ROW, "Sure, done.")
    assert not verdict.ok and calls == []


def test_valid_calls_count_parsed_calls_of_offered_functions():
    """A call to an unoffered function or with unparsed arguments does not count (mutation: all counted)."""
    calls = [{"name": "alarm_set", "arguments": {"time": "1"}}, {"name": "alarm_set", "arguments": "{bad"},
             {"name": "other", "arguments": {}}]
    assert valid_calls(ROW, calls) == 1


def test_answer_text_is_the_ground_truth_as_json():
    """Mutation: ASCII escapes or a Python repr."""
    assert answer_text({"ground_truth": [{"f": {"x": ["é"]}}]}) == '[{"f": {"x": ["é"]}}]'


def test_category_figures_per_group_with_wilson_interval():
    """Counts and accuracy per group; results without a group are left out; None when no group
    (mutation: groups mixed, or ungrouped results counted)."""
    results = [SimpleNamespace(group="simple", success=True), SimpleNamespace(group="simple", success=False),
               SimpleNamespace(group="parallel", success=True), SimpleNamespace(group="", success=False)]
    figures = category_figures(results)
    assert set(figures) == {"simple", "parallel"}
    assert figures["simple"]["episodes"] == 2 and figures["simple"]["successes"] == 1
    assert figures["simple"]["accuracy"] == 0.5
    low, high = figures["simple"]["ci95"]
    assert 0 < low < 0.5 < high < 1
    assert category_figures([SimpleNamespace(group=None, success=True)]) is None
