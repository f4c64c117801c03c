"""Reading tool calls never raises, whatever the model wrote: JSON nested past the bound or holding a
number past the bound is a failed call the model reads, as malformed JSON is (issue 45, item 13)."""

from __future__ import annotations

import pytest

from slm_align.ondevice.tools.builtin import default_tools
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.parse import MAX_DEPTH, MAX_NUMBER_CHARS, read_calls


def nested(depth: int) -> str:
    """A calculator call whose ``expression`` holds lists nested ``depth`` deep."""
    return '{"name": "calculator", "arguments": {"expression": ' + "[" * depth + "]" * depth + "}}"


def long_number(digits: int) -> str:
    return '{"name": "calculator", "arguments": {"expression": ' + "7" * digits + "}}"


DEEP = [
    "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>",  # the probe: a block nested 1,000 deep
    "<tool_call>" + "[" * 100_000 + "</tool_call>",  # opened 100,000 deep, never closed
    "<tool_call>" + nested(1000) + "</tool_call>",
    nested(5000),  # a bare call (no tags)
    '<tool_call>{"name": "calculator", "arguments": "' + ("[" * 2000 + "]" * 2000).replace('"', '\\"') + '"}'
    "</tool_call>",  # arguments as a JSON string (OpenAI's form), decoded in turn
]
LONG = [
    "<tool_call>" + long_number(100_000) + "</tool_call>",  # the probe: a 100,000-digit number
    long_number(100_000),
    "<tool_call>" + long_number(5000).replace("7" * 5000, "7" * 5000 + ".5") + "</tool_call>",  # a float
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}} ' + "9" * 20_000 + "</tool_call>",
]


@pytest.mark.parametrize("reply", DEEP, ids=["list-1000", "open-100000", "arguments-1000", "bare-5000",
                                             "string-arguments-2000"])
def test_a_call_nested_past_the_bound_is_a_failed_call_not_an_exception(reply):
    parsed = default_tools().parse_calls(reply)
    assert parsed.calls == [] and parsed.wants_tools
    [error] = parsed.errors
    assert not error.ok and f"nested deeper than {MAX_DEPTH} levels" in error.error


@pytest.mark.parametrize("reply", LONG, ids=["int-100000", "bare-int-100000", "float-5000", "second-value"])
def test_a_number_past_the_bound_is_a_failed_call_not_an_exception(reply):
    parsed = default_tools().parse_calls(reply)
    assert parsed.calls == [] and parsed.wants_tools
    [error] = parsed.errors
    assert not error.ok and f"more than {MAX_NUMBER_CHARS}" in error.error


def test_calls_within_the_bounds_still_parse():
    registry = default_tools()
    at_the_bound = '{"name": "calculator", "arguments": {"expression": "1", "x": ' + "[" * (MAX_DEPTH - 2) \
                   + "]" * (MAX_DEPTH - 2) + ', "n": ' + "9" * MAX_NUMBER_CHARS + "}}"
    _, [decoded] = read_calls(f"<tool_call>{at_the_bound}</tool_call>")
    assert decoded["arguments"]["n"] == int("9" * MAX_NUMBER_CHARS)
    parsed = registry.parse_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert parsed.calls == [ToolCall("calculator", {"expression": "2+3"})]
    one_too_deep = at_the_bound.replace('"x": [', '"x": [[', 1).replace("]]", "]]]", 1)
    [error] = registry.parse_calls(f"<tool_call>{one_too_deep}</tool_call>").errors
    assert "nested deeper" in error.error
