"""`serve` reads the model's calls of the client's tools within the parser's bounds: a reply nested 1,000 deep or
holding a 100,000-digit number is answered as text (it raised, and the request got a 500; issue 45, item 13)."""

import json

import pytest

pytest.importorskip("starlette")

from slm_align.ondevice.agent.server.service import Outcome, client_calls  # noqa: E402
from slm_align.ondevice.tools.registry import ToolRegistry  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def runs_on_the_client(**arguments):
    raise AssertionError("the client runs its own tools")


def client_tools() -> ToolRegistry:
    """The client's tools as the server registers them (``ChatBody.client_tools``)."""
    registry = ToolRegistry()
    registry.register(runs_on_the_client, name="get_weather", description="The weather.", schema=WEATHER)
    return registry


@pytest.mark.parametrize("reply", [
    "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": ' + "7" * 100_000 + "}}</tool_call>",
], ids=["nested-1000", "digits-100000"])
def test_a_reply_past_the_bounds_is_answered_as_text(reply):
    outcome = client_calls(Outcome(content=reply), client_tools())
    assert (outcome.content, outcome.tool_calls, outcome.finish_reason) == (reply, [], "stop")


def test_a_call_within_the_bounds_still_goes_to_the_client():
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    outcome = client_calls(Outcome(content=reply), client_tools())
    assert outcome.finish_reason == "tool_calls" and outcome.content is None
    assert json.loads(outcome.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
