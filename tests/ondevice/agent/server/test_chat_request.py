"""A chat request as the service takes it (server/chat_request.py): parse_chat, check_combinations,
answer_grammar, requested_model."""

from __future__ import annotations

import pytest

from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.chat_request import parse_chat, requested_model
from slm_align.ondevice.agent.server.errors import ApiError

USER = [{"role": "user", "content": "add 2 and 3"}]
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                         "parameters": {"type": "object",
                                                        "properties": {"a": {"type": "number"},
                                                                       "b": {"type": "number"}},
                                                        "required": ["a", "b"]}}}
JSON_FORMAT = {"type": "json_schema",
               "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def refused(body: dict, backend_kind: str = "gguf") -> str:
    with pytest.raises(ApiError) as caught:
        parse_chat(body, Limits(), backend_kind)
    assert caught.value.status == 400
    return str(caught.value)


def test_plain_request_defaults():
    """A bare request: no grammar, no logprobs, server tools allowed, parallel calls (mutation: defaults flipped)."""
    chat = parse_chat({"messages": USER, "model": "tiny"}, Limits())
    assert chat.messages[0]["content"] == "add 2 and 3"
    assert chat.answer_grammar is None and chat.logprobs is None
    assert chat.server_tools is True and chat.single_call is False
    assert chat.model == "tiny"


@pytest.mark.parametrize("body, model", [({"model": "a"}, "a"), ({"model": None}, None), ({"model": 3}, None),
                                         ({}, None), ([], None)])
def test_requested_model_is_text_or_none(body, model):
    """Only a string names a model (mutation: a non-string model passed on, or a list body crashing)."""
    assert requested_model(body) == model


def test_logprobs_without_top_is_zero_alternatives():
    """'logprobs': true alone asks for 0 alternatives; top_logprobs sets the count (mutation: None or ignored)."""
    assert parse_chat({"messages": USER, "logprobs": True}, Limits()).logprobs == 0
    assert parse_chat({"messages": USER, "logprobs": True, "top_logprobs": 3}, Limits()).logprobs == 3


def test_top_logprobs_needs_logprobs():
    """Mutation: the combination check dropped."""
    assert refused({"messages": USER, "top_logprobs": 2}) == "'top_logprobs' needs 'logprobs': true"


def test_logprobs_refused_with_stream():
    """Mutation: logprobs silently dropped when streaming."""
    assert "'logprobs' is not available with 'stream': true" in refused(
        {"messages": USER, "logprobs": True, "stream": True})


def test_forced_call_needs_tools():
    """'required' without tools is a 400 (mutation: a grammar built over no tools)."""
    assert refused({"messages": USER, "tool_choice": "required"}) == (
        "'tool_choice' asks for a tool call but the request offers no 'tools'")


def test_named_function_must_be_offered():
    """Naming a tool not in 'tools' is a 400 naming it (mutation: name not checked)."""
    choice = {"type": "function", "function": {"name": "mul"}}
    assert refused({"messages": USER, "tools": [TOOL], "tool_choice": choice}) == (
        "'tool_choice' names the function 'mul', which is not among 'tools'")


def test_json_format_refused_with_tools():
    """response_format and tools together are a 400, unless tool_choice is none (mutation: check dropped or
    too broad)."""
    assert "cannot be combined with 'tools'" in refused(
        {"messages": USER, "tools": [TOOL], "response_format": JSON_FORMAT})
    chat = parse_chat({"messages": USER, "tools": [TOOL], "tool_choice": "none",
                       "response_format": JSON_FORMAT}, Limits())
    assert chat.answer_grammar is not None
    assert chat.server_tools is False


def test_required_call_gets_a_grammar_naming_the_tool():
    """tool_choice required builds a grammar over the offered tool (mutation: grammar not built)."""
    chat = parse_chat({"messages": USER, "tools": [TOOL], "tool_choice": "required"}, Limits())
    assert chat.answer_grammar and "add" in chat.answer_grammar
    assert chat.client_tools is not None


def test_grammar_needs_a_gguf_backend():
    """ONNX cannot sample under a grammar: a 400 naming the field and the fix (mutation: backend not checked)."""
    message = refused({"messages": USER, "tools": [TOOL], "tool_choice": "required"}, backend_kind="onnx")
    assert message.startswith("'tool_choice' needs a GGUF model")
    assert "ONNX model" in message
    message = refused({"messages": USER, "response_format": JSON_FORMAT}, backend_kind="onnx")
    assert message.startswith("'response_format' needs a GGUF model")


def test_text_format_needs_no_grammar():
    """response_format text is the default answer (mutation: 'text' treated as JSON)."""
    chat = parse_chat({"messages": USER, "response_format": {"type": "text"}}, Limits(), "onnx")
    assert chat.answer_grammar is None and chat.server_tools is True


def test_parallel_tool_calls_false_is_single_call():
    """Mutation: parallel_tool_calls ignored."""
    assert parse_chat({"messages": USER, "parallel_tool_calls": False}, Limits()).single_call is True
