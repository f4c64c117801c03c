"""Answers in OpenAI's shapes (server/responses.py): completion bodies, chunks, the SSE stream."""

from __future__ import annotations

import asyncio
import json

from slm_align.errors import UserError
from slm_align.ondevice.agent.server.errors import ApiError
from slm_align.ondevice.agent.server.responses import (
    Meta,
    completion_body,
    last_item,
    sse,
    sse_stream,
    stream_error,
    usage,
)
from slm_align.ondevice.agent.server.service import Outcome

META = Meta("chatcmpl-1", 1700000000, "tiny", "conv-9")
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


class Chat:
    """The one field of a ChatRequest the stream reads."""

    def __init__(self, include_usage: bool):
        self.include_usage = include_usage


def events(stream) -> list:
    """The stream's events, decoded (the [DONE] marker as a string)."""
    async def collect():
        return [item async for item in stream]
    out = []
    for text in asyncio.run(collect()):
        assert text.startswith("data: ") and text.endswith("\n\n")
        payload = text[len("data: "):-2]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def pieces(*items):
    for item in items:
        yield item


def test_usage_sums_tokens():
    """total = prompt + completion (mutation: total wrong or fields swapped)."""
    assert usage(Outcome("x", prompt_tokens=7, completion_tokens=5)) == {
        "prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def test_meta_new_makes_unique_ids():
    """Each completion has its own chatcmpl- id (mutation: a constant id)."""
    first, second = Meta.new("m"), Meta.new("m")
    assert first.id.startswith("chatcmpl-") and first.id != second.id
    assert first.model == "m" and first.conversation_id is None


def test_completion_body_without_tool_calls():
    """No tool_calls key when there are none, logprobs null, turn ids passed (mutation: empty list sent, ids lost)."""
    outcome = Outcome("hi", finish_reason="length", turn_id=3, turn_token="tok", prompt_tokens=2,
                      completion_tokens=1)
    body = completion_body(META, outcome)
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                "logprobs": None, "finish_reason": "length"}]
    assert (body["x_turn_id"], body["x_turn_token"], body["x_conversation_id"]) == (3, "tok", "conv-9")
    assert body["usage"]["total_tokens"] == 3


def test_completion_body_with_tool_calls_and_logprobs():
    """Calls and logprobs go into the choice in OpenAI's shape (mutation: calls dropped, logprobs unwrapped)."""
    outcome = Outcome(None, tool_calls=[CALL], finish_reason="tool_calls", logprobs=[{"token": "a"}])
    choice = completion_body(META, outcome)["choices"][0]
    assert choice["message"]["tool_calls"] == [CALL]
    assert choice["logprobs"] == {"content": [{"token": "a"}], "refusal": None}


def test_sse_keeps_non_ascii_and_passes_strings():
    """Dicts as JSON without escapes, strings as they are (mutation: ensure_ascii, or a string JSON-quoted)."""
    assert sse({"content": "é"}) == 'data: {"content": "é"}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"


def test_stream_sends_role_pieces_finish_and_done():
    """Role first, each piece, the finish with turn ids, then [DONE]; no usage unless asked
    (mutation: a piece lost, usage always sent, finish without ids)."""
    final = Outcome("ab", finish_reason="stop", turn_id=1, turn_token="t")
    got = events(sse_stream("a", pieces("b", final), META, Chat(include_usage=False)))
    deltas = [event["choices"][0]["delta"] for event in got[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {}]
    assert got[3]["choices"][0]["finish_reason"] == "stop"
    assert (got[3]["x_turn_id"], got[3]["x_turn_token"], got[3]["x_conversation_id"]) == (1, "t", "conv-9")
    assert got[-1] == "[DONE]"


def test_stream_sends_held_back_content_tool_calls_and_usage():
    """Content not yet streamed goes out once; calls carry their index; usage chunk when asked
    (mutation: held-back content lost, index missing, include_usage ignored)."""
    final = Outcome("held", tool_calls=[CALL, CALL], finish_reason="tool_calls", streamed=False,
                    prompt_tokens=4, completion_tokens=2)
    got = events(sse_stream(final, pieces(), META, Chat(include_usage=True)))
    assert got[1]["choices"][0]["delta"] == {"content": "held"}
    calls = got[2]["choices"][0]["delta"]["tool_calls"]
    assert [call["index"] for call in calls] == [0, 1]
    assert got[4]["choices"] == [] and got[4]["usage"]["total_tokens"] == 6
    assert got[-1] == "[DONE]"


def test_streamed_content_is_not_sent_twice():
    """Content already streamed is not repeated at the end (mutation: streamed flag ignored)."""
    final = Outcome("a", streamed=True)
    got = events(sse_stream("a", pieces(final), META, Chat(include_usage=False)))
    contents = [event["choices"][0]["delta"].get("content") for event in got[:-1]]
    assert contents.count("a") == 1


def test_failure_mid_stream_ends_with_an_error_event():
    """An exception after the status line is one error event and no [DONE] (mutation: exception escapes)."""
    async def failing():
        yield "b"
        raise RuntimeError("/secret/path")
    got = events(sse_stream("a", failing(), META, Chat(include_usage=False)))
    assert got[-1] == {"error": {"message": "internal error (RuntimeError)", "type": "server_error",
                                 "param": None, "code": None}}
    assert "[DONE]" not in got


def test_stream_error_words():
    """A bug is named by type only; a UserError loses its paths; an ApiError keeps its line
    (mutation: one of the three branches dropped)."""
    assert stream_error(ValueError("x"))["error"]["message"] == "internal error (ValueError)"
    assert stream_error(UserError("bad /a/b/c.db"))["error"]["message"] == "bad c.db"
    assert stream_error(ApiError(400, "too long"))["error"]["message"] == "too long"


def test_last_item_consumes_all():
    """The last item, None for an empty stream (mutation: first item returned)."""
    assert asyncio.run(last_item(pieces(1, 2, 3))) == 3
    assert asyncio.run(last_item(pieces())) is None
