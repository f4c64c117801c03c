"""``POST /v1/completions``: OpenAI's legacy completions, plain text continued, for any
model (base models first).

No template and no tools: the prompt is tokenised as it is (BOS added, special-token text parsed, as
llama.cpp's own server does) and continued by :meth:`slm_align.ondevice.agent.runtime.Agent.complete`.
Nothing is recorded in the preference store: there is no conversation to give feedback on.
"""

from __future__ import annotations

import threading
import time
import uuid
from functools import partial
from typing import Annotated, Any, AsyncIterator, Callable, Iterator, Optional, Union

from pydantic import Field, StrictBool, StrictInt, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from slm_align.ondevice.agent.runtime import Agent, Reply
from slm_align.ondevice.agent.server.body import (
    Body,
    NonEmpty,
    Stop,
    Tokens,
    read_json,
    refuse_unsupported,
    request_seed,
    stop_list,
)
from slm_align.ondevice.agent.server.chat_request import requested_model
from slm_align.ondevice.agent.server.refusals import validate
from slm_align.ondevice.agent.server.responses import Meta, last_item, sse, stream_error
from slm_align.ondevice.agent.server.routes import SSE_HEADERS, client_left
from slm_align.ondevice.agent.settings import DEFAULTS, SamplingParams, Seed, Temperature, TopP

LEGACY_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions."""
UNSUPPORTED = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "logprobs": (None,),
               "logit_bias": (None, {}), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
               "stream_options": (None,)}
"""Legacy completion fields not implemented here, with the values that change
nothing (any other is a 400)."""


class CompletionBody(Body):
    """An OpenAI (legacy) completion request; fields are checked in this order (the
    first error is the answer)."""

    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    """Completions per request: only 1."""
    prompt: Annotated[NonEmpty, Field(description="the text to continue")]
    """As it is (no template)."""
    max_tokens: Tokens = LEGACY_MAX_TOKENS
    """Most tokens of the continuation (OpenAI's default: 16)."""
    temperature: Temperature = DEFAULTS.temperature
    top_p: TopP = DEFAULTS.top_p
    stop: Stop = Field(default_factory=list)
    """Strings that end the continuation (not included in it)."""
    seed: Optional[Seed] = None
    """Default: drawn at random."""
    stream: StrictBool = False
    """Send the continuation as server-sent events."""

    @model_validator(mode="before")
    @classmethod
    def _nothing_unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, UNSUPPORTED, cls.model_fields)
        return data

    def sampling(self) -> SamplingParams:
        """Sampling from the request; top-k and penalties keep the runtime's defaults."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              stop=stop_list(self.stop), seed=request_seed(self.seed))


def continuation(service, prompt: str, sampling: SamplingParams, apply: Callable[[], None],
                 cancel: threading.Event) -> Iterator[Union[str, Reply]]:
    """On a model thread: ``apply`` the request's adapters, then the pieces of ``prompt``'s
    continuation, then its :class:`Reply` (on a lane of the batched engine when there is one)."""
    with service.lease() as backend:
        apply()
        agent = Agent(backend, service.model.sha256, sampling=sampling, cancel=cancel)
        yield from agent.complete(prompt)
        yield agent.last


def finish_reason(reply: Reply) -> str:
    """OpenAI's finish_reason: length when ``max_tokens`` cut the continuation, else stop."""
    return "length" if reply.truncated else "stop"


def text_completion(meta: Meta, text: str, reason: Optional[str] = None) -> dict:
    """A ``text_completion`` object (a whole answer, or one streamed piece of it)."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}]}


def completion_body(meta: Meta, reply: Reply) -> dict:
    """The whole continuation with its token usage."""
    usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.tokens,
             "total_tokens": reply.prompt_tokens + reply.tokens}
    return {**text_completion(meta, reply.text, finish_reason(reply)), "usage": usage}


async def text_stream(first: Any, rest: AsyncIterator, meta: Meta) -> AsyncIterator[str]:
    """The continuation as ``text_completion`` events: its pieces, the
    finish reason, then [DONE]."""
    try:
        item = first
        while isinstance(item, str):
            yield sse(text_completion(meta, item))
            item = await anext(rest)
    except Exception as exc:  # the status line went out already: report in the stream
        yield sse(stream_error(exc))
        return
    yield sse(text_completion(meta, "", finish_reason(item)))
    yield sse("[DONE]")


async def completions(request: Request):
    """``POST /v1/completions``: ``prompt`` continued as plain text, whole or streamed
    by server-sent events."""
    service = request.app.state.service
    body = await read_json(request, service.limits.max_body_bytes)
    wanted = validate(CompletionBody, body, service.limits)
    chosen = service.router.pick(requested_model(body))  # nothing recorded: no A/B routing
    job = partial(continuation, service, wanted.prompt, wanted.sampling(), partial(service.router.apply, chosen))
    events = service.worker.run(job, request.receive)
    first = await anext(events, None)  # a full queue or a prompt too long is refused here, before any byte is sent
    if first is None:
        return client_left()
    meta = Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), chosen.name)
    if wanted.stream:
        return StreamingResponse(text_stream(first, events, meta), media_type="text/event-stream", headers=SSE_HEADERS)
    reply = first if isinstance(first, Reply) else await last_item(events)
    if not isinstance(reply, Reply):
        return client_left()
    return JSONResponse(completion_body(meta, reply))


COMPLETION_ROUTES = [Route("/v1/completions", completions, methods=["POST"])]
