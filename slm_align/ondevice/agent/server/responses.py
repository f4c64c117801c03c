"""Answers in OpenAI's shapes: ``chat.completion`` objects, and
``chat.completion.chunk`` server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from slm_align.errors import UserError
from slm_align.ondevice.agent.server.chat_request import ChatRequest
from slm_align.ondevice.agent.server.errors import ApiError, client_text
from slm_align.ondevice.agent.server.service import Outcome


@dataclass
class Meta:
    """What every response and chunk of one completion repeats."""

    id: str
    created: int
    model: str
    conversation_id: Optional[str] = None
    """The conversation's id, as the server signed it: the next turn passes it as ``x_conversation_id``."""

    @classmethod
    def new(cls, model: str, conversation_id: Optional[str] = None) -> "Meta":
        """A fresh completion id, stamped now."""
        return cls(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, conversation_id)


def usage(outcome: Outcome) -> dict:
    """OpenAI's token usage of an answer."""
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def completion_body(meta: Meta, outcome: Outcome) -> dict:
    """A ``chat.completion`` object, plus ``x_turn_id`` and ``x_turn_token`` (feedback on
    the turn presents both) and ``x_conversation_id`` (the next turn of the conversation passes it)."""
    message = {"role": "assistant", "content": outcome.content}
    if outcome.tool_calls:
        message["tool_calls"] = outcome.tool_calls
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "message": message, "logprobs": _logprobs(outcome),
                         "finish_reason": outcome.finish_reason}],
            "usage": usage(outcome), "x_turn_id": outcome.turn_id, "x_turn_token": outcome.turn_token,
            "x_conversation_id": meta.conversation_id}


def _logprobs(outcome: Outcome) -> Optional[dict]:
    return None if outcome.logprobs is None else {"content": outcome.logprobs, "refusal": None}


def chunk(meta: Meta, delta: dict, finish_reason: Optional[str] = None, **extra: Any) -> dict:
    """A ``chat.completion.chunk`` object."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], **extra}


def sse(data: Union[dict, str]) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_stream(first: Any, rest: AsyncIterator, meta: Meta, chat: ChatRequest) -> AsyncIterator[str]:
    """The answer as chunks: role, content pieces, held-back content or tool calls,
    finish, usage, [DONE]."""
    yield sse(chunk(meta, {"role": "assistant", "content": ""}))
    try:
        item = first
        while isinstance(item, str):
            yield sse(chunk(meta, {"content": item}))
            item = await anext(rest)
    except Exception as exc:  # the status line went out already: report in the stream
        yield sse(stream_error(exc))
        return
    if not item.streamed and item.content:
        yield sse(chunk(meta, {"content": item.content}))
    if item.tool_calls:
        yield sse(chunk(meta, {"tool_calls": [{"index": i, **call} for i, call in enumerate(item.tool_calls)]}))
    yield sse(chunk(meta, {}, item.finish_reason, x_turn_id=item.turn_id, x_turn_token=item.turn_token,
                    x_conversation_id=meta.conversation_id))
    if chat.include_usage:
        yield sse({**chunk(meta, {}), "choices": [], "usage": usage(item)})
    yield sse("[DONE]")


def stream_error(exc: Exception) -> dict:
    """The error event of a stream that failed after its status line went out (a bug
    named, not described)."""
    message = f"internal error ({type(exc).__name__})"
    if isinstance(exc, UserError):
        message = client_text(exc)
    if isinstance(exc, ApiError):
        message = str(exc)
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


async def last_item(items: AsyncIterator) -> Any:
    """The last item of ``items`` (all of them are consumed)."""
    last = None
    async for item in items:
        last = item
    return last
