"""The chat request the service answers: a validated :class:`ChatBody` in the runtime's shapes, with
the grammar that a forced tool call or a JSON ``response_format`` samples under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slm_align.errors import UserError
from slm_align.ondevice.agent.constrain import json_grammar
from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.chat_body import ChatBody, NamedToolChoice
from slm_align.ondevice.agent.server.errors import bad
from slm_align.ondevice.agent.server.refusals import validate
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.tools.registry import ToolRegistry


@dataclass
class ChatRequest:
    """A validated chat completion request, in the runtime's message shape."""

    messages: list[dict]
    """The conversation, ``{"role", "content": str}`` (+ ``tool_calls`` / ``name``) as
    chat templates take it."""
    sampling: SamplingParams
    """How to sample the answer."""
    stream: bool = False
    """Answer by server-sent events."""
    include_usage: bool = False
    """Streaming: send a last chunk with token usage (``stream_options.include_usage``)."""
    client_tools: Optional[ToolRegistry] = None
    """Function tools the client runs: the model's calls go back to it as ``tool_calls``."""
    server_tools: bool = True
    """May the server's own tools (``--tools``) be used (``tool_choice`` "none" says no)."""
    conversation_id: Optional[str] = None
    """Groups the turns of one conversation in the store (``x_conversation_id``)."""
    answer_grammar: Optional[str] = None
    """A llama.cpp grammar the answer follows (``tool_choice`` required or named, a
    JSON ``response_format``)."""
    logprobs: Optional[int] = None
    """Report each token's log-probability with this many alternatives (None:
    ``logprobs`` not asked for)."""
    single_call: bool = False
    """``parallel_tool_calls`` false: at most one call goes back."""
    model: Optional[str] = None
    """The request's ``model``: which adapter set answers (see :mod:`slm_align.ondevice.agent.server.adapters`)."""
    arm: Optional[str] = None
    """The A/B test's arm when the trial routed the request ('current' or 'candidate'; None: not routed)."""
    client: str = ""
    """Who sent it (the peer's address): the A/B test counts each client's conversations up to a cap."""


def parse_chat(body: dict, limits: Limits, backend_kind: str = "gguf") -> ChatRequest:
    """Validate an OpenAI chat completion request; wrong shapes and values, and what
    ``backend_kind`` cannot do, are 400s naming the field."""
    chat = validate(ChatBody, body, limits)
    check_combinations(chat)
    tools = chat.client_tools()
    return ChatRequest(messages=chat.runtime_messages(), sampling=chat.sampling(), stream=chat.stream,
                       include_usage=chat.include_usage, client_tools=tools,
                       server_tools=chat.tool_choice != "none" and not _wants_json(chat),
                       conversation_id=chat.x_conversation_id, answer_grammar=answer_grammar(chat, tools, backend_kind),
                       logprobs=_logprobs(chat), single_call=not chat.parallel_tool_calls,
                       model=requested_model(body))


def requested_model(body: dict) -> Optional[str]:
    """The ``model`` a request names (None: left out, null or not text)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _forced_call(chat: ChatBody) -> bool:
    return chat.tool_choice == "required" or isinstance(chat.tool_choice, NamedToolChoice)


def _wants_json(chat: ChatBody) -> bool:
    return chat.response_format is not None and chat.response_format.type != "text"


def _logprobs(chat: ChatBody) -> Optional[int]:
    if not chat.logprobs:
        return None
    return chat.top_logprobs or 0


def check_combinations(chat: ChatBody) -> None:
    """400s for fields that contradict each other (each alone was valid)."""
    if chat.top_logprobs is not None and not chat.logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true")
    if chat.logprobs and chat.stream:
        raise bad("'logprobs' is not available with 'stream': true on this "
                  "server; ask without streaming")
    if _forced_call(chat) and not chat.tools:
        raise bad("'tool_choice' asks for a tool call but the request offers no 'tools'")
    named = chat.tool_choice.function.name if isinstance(chat.tool_choice, NamedToolChoice) else None
    if named is not None and named not in [tool.function.name for tool in chat.tools]:
        raise bad(f"'tool_choice' names the function {named[:64]!r}, which is not among 'tools'")
    if _wants_json(chat) and chat.tools and chat.tool_choice != "none":
        raise bad("'response_format' cannot be combined with 'tools' on this "
                  "server; send one or the other")


def answer_grammar(chat: ChatBody, tools: Optional[ToolRegistry], backend_kind: str) -> Optional[str]:
    """The grammar that makes the answer a call (``tool_choice``) or JSON (``response_format``); a
    400 when the backend cannot sample under a grammar."""
    field = "tool_choice" if _forced_call(chat) else "response_format"
    if not (_forced_call(chat) or _wants_json(chat)):
        return None
    if backend_kind != "gguf":
        raise bad(f"'{field}' needs a GGUF model (a llama.cpp grammar constrains the answer); this "
                  f"server runs an {backend_kind.upper()} model: leave '{field}' out, "
                  "or serve the GGUF export")
    if field == "tool_choice":
        named = chat.tool_choice.function.name if isinstance(chat.tool_choice, NamedToolChoice) else None
        return tools.gbnf_grammar(required=True, names=[named] if named else None)
    schema = chat.response_format.json_schema
    try:
        return json_grammar(schema.json_schema if schema is not None else None)
    except UserError as exc:
        raise bad(f"'response_format': {exc}") from None
