"""``slm-align serve``: an OpenAI-compatible chat endpoint and a feedback page over one exported model.

    app = create_app("model-Q8_0.gguf", store_path="prefs.db", consent=True)   # a Starlette app
    serve("model-Q8_0.gguf", port=8080, store_path="prefs.db")                  # ... run by uvicorn

Routes: ``POST /v1/chat/completions`` (OpenAI request and response shapes, streaming by server-sent events,
client-side function tools), ``GET /v1/models``, ``POST /v1/feedback``, ``POST /v1/alternative``, ``GET /health``
and the chat page at ``/``. Answers carry a non-standard ``x_turn_id``: the turn's id in the preference store,
which feedback refers to; a request may carry ``x_conversation_id`` to group its turns.

One model, one thread: every generation runs on a single worker thread, in arrival order; at most
``max_queue`` requests wait behind the running one and later ones get 503. Bad requests get an OpenAI-style
``{"error": {"message", "type"}}`` with a 4xx status and the server keeps serving.

Torch-free like the rest of ``slm_align.agent``: Starlette here, uvicorn only inside :func:`serve`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from slm_align.agent.backend import open_backend
from slm_align.agent.runtime import Agent, artifact_id, device_settings
from slm_align.agent.sampling import SamplingParams
from slm_align.agent.store import FEEDBACK_KINDS, PREFERRED, PreferenceStore, Turn
from slm_align.agent.tools import ToolRegistry
from slm_align.errors import UserError

LOOPBACK_NAMES = ("localhost",)
ROLES = ("system", "user", "assistant", "tool")
SEED_SPAN = 2 ** 32
PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass
class Limits:
    """What one request may ask of the server; beyond it the answer is a 4xx (or 503) and serving goes on."""

    max_body_bytes: int = 1 << 20
    """Largest request body in bytes; a larger one gets 413."""
    max_queue: int = 16
    """Requests that may wait for the model behind the running one; more get 503."""
    max_messages: int = 256
    """Most messages in one chat request."""
    max_message_chars: int = 32_000
    """Longest text of one message, feedback text or edit."""
    max_tokens: int = 4096
    """Most tokens one answer may ask for (``max_tokens`` / ``max_completion_tokens``)."""
    max_tools: int = 64
    """Most function tools one request may offer."""
    max_stop: int = 4
    """Most stop strings one request may give (OpenAI's limit)."""


# --- errors -----------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type and a one-line message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), self.kind, self.headers)


def error_response(status: int, message: str, kind: str, headers: Optional[dict] = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


def bad(message: str) -> ApiError:
    return ApiError(400, message)


_HTTP_KINDS = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _on_user_error(request: Request, exc: UserError) -> JSONResponse:
    return error_response(400, str(exc), "invalid_request_error")


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, exc.detail, _HTTP_KINDS.get(exc.status_code, "invalid_request_error"),
                          getattr(exc, "headers", None))


async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error ({type(exc).__name__}); the server keeps running", "server_error")


# --- reading requests -------------------------------------------------------------------------------------------


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, refused with 413 past ``limit`` bytes (declared or actually sent).

    Only ``Content-Type: application/json`` is read (415 otherwise): a page on another site can send text/plain
    or form posts to a loopback server without asking, but not JSON.
    """
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the body as JSON with the header 'Content-Type: application/json'")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise bad(f"the body is not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object")
    return data


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes; send fewer or shorter messages")


def _field(body: dict, key: str, kinds: tuple, what: str, default: Any = None) -> Any:
    """``body[key]`` if it has one of ``kinds`` (a bool is not a number), ``default`` when missing or null."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad(f"'{key}' must be {what}, got {json.dumps(value)[:60]}")
    return value


def _number(body: dict, key: str, low: float, high: float, default: Any = None) -> Any:
    value = _field(body, key, (int, float), f"a number from {low} to {high}", default)
    if value is not None and not low <= value <= high:
        raise bad(f"'{key}' must be a number from {low} to {high}, got {value}")
    return value


def _integer(body: dict, key: str, low: int, high: Optional[int] = None, default: Any = None) -> Any:
    span = f"an integer from {low}" + (f" to {high}" if high is not None else "")
    value = _field(body, key, (int,), span, default)
    if value is not None and (value < low or (high is not None and value > high)):
        raise bad(f"'{key}' must be {span}, got {value}")
    return value


def _text(body: dict, key: str, limit: int, required: bool = False) -> Optional[str]:
    value = _field(body, key, (str,), "text")
    if required and not (value or "").strip():
        raise bad(f"'{key}' is required: non-empty text")
    if value is not None and len(value) > limit:
        raise bad(f"'{key}' is longer than {limit} characters")
    return value


# --- chat requests ----------------------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    """A validated chat completion request, in the runtime's message shape."""

    messages: list[dict]
    """The conversation, ``{"role", "content": str}`` (+ ``tool_calls`` / ``name``) as chat templates take it."""
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


def parse_chat(body: dict, limits: Limits) -> ChatRequest:
    """Validate an OpenAI chat completion request; wrong shapes and values are 400s naming the field."""
    if _integer(body, "n", 1, 1, 1) != 1:
        raise bad("'n' must be 1: this server answers with one choice")
    tool_choice = body.get("tool_choice")
    client_tools = parse_tools(body, limits) if tool_choice != "none" else None
    options = _field(body, "stream_options", (dict,), "an object", {})
    return ChatRequest(
        messages=parse_messages(body.get("messages"), limits),
        sampling=parse_sampling(body, limits),
        stream=_field(body, "stream", (bool,), "true or false", False),
        include_usage=_field(options, "include_usage", (bool,), "true or false", False),
        client_tools=client_tools,
        server_tools=tool_choice != "none",
        conversation_id=_text(body, "x_conversation_id", 128),
    )


def parse_sampling(body: dict, limits: Limits) -> SamplingParams:
    """Sampling from the request; a missing seed is drawn at random (and recorded with the turn)."""
    defaults = SamplingParams()
    max_tokens = _integer(body, "max_completion_tokens", 1, limits.max_tokens)
    return SamplingParams(
        temperature=_number(body, "temperature", 0, 2, defaults.temperature),
        top_p=_number(body, "top_p", 0, 1, defaults.top_p),
        top_k=_integer(body, "top_k", 0, None, defaults.top_k),
        max_tokens=max_tokens or _integer(body, "max_tokens", 1, limits.max_tokens, defaults.max_tokens),
        stop=parse_stop(body.get("stop"), limits),
        seed=_seed(_field(body, "seed", (int,), "an integer")),
    )


def _seed(seed: Optional[int]) -> int:
    """Any integer seed, folded into the 32 bits both backends take; a random one when none is given."""
    return secrets.randbits(32) if seed is None else seed % SEED_SPAN


def parse_stop(stop: Any, limits: Limits) -> list[str]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > limits.max_stop:
        raise bad(f"'stop' must be a non-empty string or a list of at most {limits.max_stop} of them")
    return stops


def parse_messages(raw: Any, limits: Limits) -> list[dict]:
    """OpenAI messages in the runtime's shape; tool results get the name of the call they answer."""
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list of {role, content} objects")
    if len(raw) > limits.max_messages:
        raise bad(f"'messages' has {len(raw)} messages; at most {limits.max_messages} are accepted")
    call_names: dict[str, str] = {}
    return [parse_message(message, f"messages[{i}]", limits, call_names) for i, message in enumerate(raw)]


def parse_message(raw: Any, where: str, limits: Limits, call_names: dict) -> dict:
    if not isinstance(raw, dict):
        raise bad(f"{where} must be an object with a role and content")
    role = "system" if raw.get("role") == "developer" else raw.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(raw.get('role'))[:40]}")
    message = {"role": role, "content": message_text(raw.get("content"), where, limits)}
    if role == "assistant" and raw.get("tool_calls") is not None:
        message["tool_calls"] = parse_tool_calls(raw["tool_calls"], f"{where}.tool_calls", call_names)
    if role == "tool":
        named = raw.get("name")
        message["name"] = named if isinstance(named, str) else call_names.get(raw.get("tool_call_id"), "")
    return message


def message_text(content: Any, where: str, limits: Limits) -> str:
    """A message's text: a string, a list of text parts, or nothing (an assistant's bare tool calls)."""
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in content):
        text = "".join(part["text"] for part in content)
    else:
        raise bad(f"{where}.content must be text or a list of text parts (this model reads text only)")
    if len(text) > limits.max_message_chars:
        raise bad(f"{where}.content is longer than {limits.max_message_chars} characters")
    return text


def parse_tool_calls(raw: Any, where: str, call_names: dict) -> list[dict]:
    """An assistant's OpenAI tool calls (arguments as JSON text) as chat templates take them (arguments as dicts)."""
    if not isinstance(raw, list):
        raise bad(f"{where} must be a list of function calls")
    calls = []
    for i, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        calls.append({"type": "function", "function": {"name": function["name"],
                                                       "arguments": _arguments(function.get("arguments"))}})
        if isinstance(call.get("id"), str):
            call_names[call["id"]] = function["name"]
    return calls


def _arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def parse_tools(body: dict, limits: Limits) -> Optional[ToolRegistry]:
    """The request's function tools as a registry that parses the model's calls (the client runs them)."""
    specs = _field(body, "tools", (list,), "a list of function tools", [])
    if not specs:
        return None
    if len(specs) > limits.max_tools:
        raise bad(f"'tools' has {len(specs)} tools; at most {limits.max_tools} are accepted")
    registry = ToolRegistry()
    for i, spec in enumerate(specs):
        is_function = isinstance(spec, dict) and spec.get("type", "function") == "function"
        function = spec.get("function") if is_function else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                      "\"parameters\"}}}}")
        registry.register(_runs_on_the_client, name=function["name"],
                          description=function.get("description") or function["name"],
                          schema=function.get("parameters") or {"type": "object", "properties": {}})
    return registry


def _runs_on_the_client(**arguments: Any) -> None:
    """A client-side tool: the server returns the call instead of running it."""
    raise RuntimeError("client-side tools are run by the client")


# --- feedback requests ------------------------------------------------------------------------------------------


@dataclass
class FeedbackRequest:
    """A verdict on a recorded turn, as the page and API clients send it."""

    turn_id: int
    """The ``x_turn_id`` of the answer."""
    kind: str
    """up, down, choice or edit."""
    text: Optional[str] = None
    """edit: the corrected answer."""
    other: Optional[str] = None
    """choice: the other candidate (from /v1/alternative)."""
    preferred: str = "this"
    """choice: which answer won, 'this' (the turn's) or 'other'."""


def parse_feedback(body: dict, limits: Limits) -> FeedbackRequest:
    kind = _field(body, "kind", (str,), f"one of {', '.join(FEEDBACK_KINDS)}")
    if kind not in FEEDBACK_KINDS:
        raise bad(f"'kind' must be one of {', '.join(FEEDBACK_KINDS)}")
    preferred = _field(body, "preferred", (str,), "'this' or 'other'", "this")
    if preferred not in PREFERRED:
        raise bad("'preferred' must be 'this' or 'other'")
    return FeedbackRequest(turn_id=_turn_id(body), kind=kind, preferred=preferred,
                           text=_text(body, "text", limits.max_message_chars, required=kind == "edit"),
                           other=_text(body, "other", limits.max_message_chars, required=kind == "choice"))


def _turn_id(body: dict) -> int:
    turn_id = _integer(body, "turn_id", 1)
    if turn_id is None:
        raise bad("'turn_id' is required: the x_turn_id of the answer")
    return turn_id


def record_feedback(store: PreferenceStore, feedback: FeedbackRequest) -> int:
    """Write the verdict; returns the feedback row's id."""
    if feedback.kind in ("up", "down"):
        return store.thumbs(feedback.turn_id, feedback.kind == "up")
    if feedback.kind == "edit":
        return store.edit(feedback.turn_id, feedback.text)
    return store.choose(feedback.turn_id, feedback.other, feedback.preferred)


# --- the model thread -------------------------------------------------------------------------------------------


class ModelWorker:
    """One thread runs every generation in arrival order; at most ``max_queue`` requests wait for it."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slm-align-model")
        self._lock = threading.Lock()
        self.active = 0
        """Requests running or waiting."""
        self.abandoned = 0
        """Requests whose client left before the answer was complete (their job stops at its next item)."""

    def _admit(self) -> None:
        with self._lock:
            if self.active > self.max_queue:
                raise ApiError(503, f"the model is busy ({self.active} requests running or queued); retry shortly",
                               "server_overloaded", {"Retry-After": "1"})
            self.active += 1

    def _release(self) -> None:
        with self._lock:
            self.active -= 1

    async def run(self, job: Callable[[], Iterator]) -> AsyncIterator:
        """The items of ``job()``, made on the model thread and handed over as they come.

        Raises ApiError 503 when the queue is full. Closing the iterator early (a client that left) stops the job
        at its next item.
        """
        self._admit()
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def hand_over(kind: str, value: Any = None) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, (kind, value))
            except RuntimeError:  # the event loop closed (shutdown): nobody is waiting
                pass

        def work() -> None:
            try:
                if not stop.is_set():
                    self._produce(job(), stop, hand_over)
            except BaseException as exc:  # handed to the request, raised there
                hand_over("error", exc)
            finally:
                self._release()
                hand_over("end")

        self._executor.submit(work)
        kind = None
        try:
            while kind != "end":
                kind, value = await items.get()
                if kind == "error":
                    raise value
                if kind == "item":
                    yield value
        finally:
            if kind not in ("end", "error"):
                stop.set()
                with self._lock:
                    self.abandoned += 1

    @staticmethod
    def _produce(generator: Iterator, stop: threading.Event, hand_over: Callable) -> None:
        try:
            for item in generator:
                hand_over("item", item)
                if stop.is_set():
                    return
        finally:
            close = getattr(generator, "close", None)
            if close:
                close()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# --- answering --------------------------------------------------------------------------------------------------


@dataclass
class Model:
    """The loaded artifact every request shares (only the model thread touches the backend)."""

    backend: Any
    """The llama.cpp or onnxruntime backend."""
    sha256: str
    """Identifies the model in preference records."""
    name: str
    """What /v1/models lists and responses name as ``model``."""


@dataclass
class Outcome:
    """How a chat request ended: the last item of a chat job."""

    content: Optional[str]
    """The answer text (without tool-call blocks when the client's tools were called)."""
    tool_calls: list = field(default_factory=list)
    """OpenAI-shaped calls for the client to run."""
    finish_reason: str = "stop"
    """stop, length or tool_calls."""
    turn_id: Optional[int] = None
    """The turn's id in the preference store (None without a store)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    streamed: bool = True
    """The content already went out piece by piece (False: it was held back to look for tool calls)."""


class Service:
    """Everything the routes share: the model, its thread, the store, the server-side tools and the limits."""

    def __init__(self, model: Model, store: Optional[PreferenceStore], consent: bool,
                 tools: Optional[ToolRegistry], limits: Limits):
        self.model, self.store, self.consent, self.tools, self.limits = model, store, consent, tools, limits
        self.worker = ModelWorker(limits.max_queue)

    # chat (on the model thread)
    def answer(self, chat: ChatRequest) -> Iterator[Union[str, Outcome]]:
        """Text pieces of the answer (unless held back for client tools), then its :class:`Outcome`."""
        agent = self._agent(chat)
        held_back = chat.client_tools is not None
        for piece in agent.respond(chat.messages):
            if not held_back:
                yield piece
        reply = agent.last
        outcome = Outcome(content=reply.text, finish_reason="length" if reply.truncated else "stop",
                          turn_id=reply.turn_id, prompt_tokens=reply.prompt_tokens, streamed=not held_back,
                          completion_tokens=reply.tokens)
        yield client_calls(outcome, chat.client_tools) if held_back else outcome

    def _agent(self, chat: ChatRequest) -> Agent:
        """A fresh agent on the shared backend: client tools are returned, server tools run in its loop."""
        tools = chat.client_tools or (self.tools if chat.server_tools else None)
        agent = Agent(self.model.backend, self.model.sha256, tools=tools, sampling=chat.sampling, store=self.store,
                      consent=self.consent, max_tool_rounds=0 if chat.client_tools else 4)
        agent.conversation_id = chat.conversation_id or agent.conversation_id
        return agent

    # alternatives
    def stored_turn(self, turn_id: int) -> Turn:
        """The turn with its prompt and sampling."""
        found = self.require_store().turn(turn_id)
        if found is None:
            raise ApiError(404, f"unknown turn id {turn_id}; pass the x_turn_id of an answer", "not_found_error")
        return found

    def alternative(self, turn: Turn, seed: Optional[int]) -> Iterator[str]:
        """A second answer to the turn's prompt, with another seed (sampled even when the first was greedy)."""
        params = _stored_sampling(turn.sampling)
        params.seed = _seed(params.seed + 1 if seed is None else seed)
        params.temperature = params.temperature if params.temperature > 0 else 0.8
        yield Agent(self.model.backend, self.model.sha256, sampling=params).alternative(turn.messages, seed=params.seed)

    def require_store(self) -> PreferenceStore:
        if self.store is None:
            raise bad("this server records no turns; start it with --store FILE to collect feedback")
        return self.store

    def close(self) -> None:
        self.worker.close()
        if self.store is not None:
            self.store.close()


def client_calls(outcome: Outcome, tools: ToolRegistry) -> Outcome:
    """The outcome with the model's calls of the client's tools as OpenAI ``tool_calls`` (if it made any)."""
    parsed = tools.parse_calls(outcome.content or "")
    if not parsed.calls:
        return outcome
    outcome.tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                          for call in parsed.calls]
    outcome.content, outcome.finish_reason = parsed.text or None, "tool_calls"
    return outcome


def _stored_sampling(recorded: dict) -> SamplingParams:
    known = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{key: value for key, value in recorded.items() if key in known})


# --- responses --------------------------------------------------------------------------------------------------


@dataclass
class Meta:
    """What every response and chunk of one completion repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, model: str) -> "Meta":
        return cls(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model)


def usage(outcome: Outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def completion_body(meta: Meta, outcome: Outcome) -> dict:
    """A ``chat.completion`` object, plus ``x_turn_id``."""
    message = {"role": "assistant", "content": outcome.content}
    if outcome.tool_calls:
        message["tool_calls"] = outcome.tool_calls
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": outcome.finish_reason}],
            "usage": usage(outcome), "x_turn_id": outcome.turn_id}


def chunk(meta: Meta, delta: dict, finish_reason: Optional[str] = None, **extra: Any) -> dict:
    """A ``chat.completion.chunk`` object."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], **extra}


def sse(data: Union[dict, str]) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_stream(first: Any, rest: AsyncIterator, meta: Meta, chat: ChatRequest) -> AsyncIterator[str]:
    """The answer as chunks: role, content pieces, held-back content or tool calls, finish, usage, [DONE]."""
    yield sse(chunk(meta, {"role": "assistant", "content": ""}))
    try:
        item = first
        while isinstance(item, str):
            yield sse(chunk(meta, {"content": item}))
            item = await anext(rest)
    except Exception as exc:  # the status line went out already: report in the stream
        message = str(exc) if isinstance(exc, (UserError, ApiError)) else f"internal error ({type(exc).__name__})"
        yield sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
        return
    if not item.streamed and item.content:
        yield sse(chunk(meta, {"content": item.content}))
    if item.tool_calls:
        yield sse(chunk(meta, {"tool_calls": [{"index": i, **call} for i, call in enumerate(item.tool_calls)]}))
    yield sse(chunk(meta, {}, item.finish_reason, x_turn_id=item.turn_id))
    if chat.include_usage:
        yield sse({**chunk(meta, {}), "choices": [], "usage": usage(item)})
    yield sse("[DONE]")


async def _last(items: AsyncIterator) -> Any:
    last = None
    async for item in items:
        last = item
    return last


# --- routes -----------------------------------------------------------------------------------------------------


def _service(request: Request) -> Service:
    return request.app.state.service


async def chat_completions(request: Request):
    service = _service(request)
    chat = parse_chat(await read_json(request, service.limits.max_body_bytes), service.limits)
    events = service.worker.run(lambda: service.answer(chat))
    first = await anext(events)  # a full queue or a prompt too long is refused here, before any byte is sent
    meta = Meta.new(service.model.name)
    if chat.stream:
        return StreamingResponse(sse_stream(first, events, meta, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outcome = first if isinstance(first, Outcome) else await _last(events)
    return JSONResponse(completion_body(meta, outcome))


async def feedback(request: Request):
    service = _service(request)
    verdict = parse_feedback(await read_json(request, service.limits.max_body_bytes), service.limits)
    feedback_id = await run_in_threadpool(record_feedback, service.require_store(), verdict)
    return JSONResponse({"object": "feedback", "id": feedback_id, "turn_id": verdict.turn_id, "kind": verdict.kind})


async def alternative(request: Request):
    service = _service(request)
    body = await read_json(request, service.limits.max_body_bytes)
    turn_id, seed = _turn_id(body), _field(body, "seed", (int,), "an integer")
    turn = await run_in_threadpool(service.stored_turn, turn_id)
    text = await _last(service.worker.run(lambda: service.alternative(turn, seed)))
    return JSONResponse({"object": "alternative", "turn_id": turn_id, "content": text})


async def models(request: Request):
    model = _service(request).model
    return JSONResponse({"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                                     "owned_by": "slm-align", "x_sha256": model.sha256}]})


async def health(request: Request):
    service = _service(request)
    return JSONResponse({"status": "ok", "model": service.model.name, "backend": service.model.backend.kind,
                         "store": service.store is not None, "tools": service.tools is not None,
                         "active_requests": service.worker.active, "abandoned_requests": service.worker.abandoned})


async def page(request: Request):
    return HTMLResponse(request.app.state.page, headers={"Content-Security-Policy": PAGE_CSP,
                                                          "X-Content-Type-Options": "nosniff"})


class BearerAuth:
    """ASGI middleware: every /v1 route needs ``Authorization: Bearer KEY`` (the page and /health do not)."""

    def __init__(self, app, key: str):
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            response = error_response(401, "missing or wrong API key; send the header 'Authorization: Bearer KEY'",
                                      "authentication_error", {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        sent = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(sent, self._expected)


# --- building and running ---------------------------------------------------------------------------------------


def load_model(artifact: Path, device: Optional[str], threads: Optional[int], n_ctx: Optional[int]) -> Model:
    """Open the artifact once (threads and context from the device profile when one is named)."""
    if device is not None:
        threads, n_ctx = device_settings(artifact, device, threads, n_ctx)
    return Model(open_backend(artifact, threads=threads, n_ctx=n_ctx), artifact_id(artifact), artifact.name)


def read_page() -> str:
    return resources.files("slm_align.agent").joinpath("static/index.html").read_text(encoding="utf-8")


def create_app(artifact: Union[str, Path], store_path: Union[str, Path, None] = None, api_key: Optional[str] = None,
               consent: bool = False, tools: bool = False, notes: Union[str, Path, None] = None,
               device: Optional[str] = None, threads: Optional[int] = None, n_ctx: Optional[int] = None,
               **limits: int) -> Starlette:
    """The server as an ASGI app (run it with uvicorn or :func:`serve`).

    Args:
        artifact: A .gguf file or an ONNX export directory.
        store_path: Preference database to record turns and feedback in (None: record nothing).
        api_key: When set, every /v1 route needs ``Authorization: Bearer <api_key>``.
        consent: Mark recorded turns as consented for training.
        tools: Run the built-in tools (calculator, clock, and notes in ``notes``) on the server.
        notes: Folder the notes tools may use (with ``tools``).
        device, threads, n_ctx: How to load the model, as for ``Agent.load``.
        limits: Any :class:`Limits` field (max_body_bytes, max_queue, max_messages, ...).
    """
    from slm_align.agent.builtin_tools import default_tools

    settings = Limits(**limits)
    model = load_model(Path(artifact), device, threads, n_ctx)
    store = PreferenceStore(Path(store_path)) if store_path is not None else None
    service = Service(model, store, consent, default_tools(notes) if tools else None, settings)

    @asynccontextmanager
    async def lifespan(app):
        yield
        service.close()

    routes = [Route("/", page), Route("/health", health), Route("/v1/models", models),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/feedback", feedback, methods=["POST"]),
              Route("/v1/alternative", alternative, methods=["POST"])]
    handlers = {ApiError: _on_api_error, UserError: _on_user_error, HTTPException: _on_http_error, Exception: _on_bug}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    app.state.service, app.state.page = service, read_page()
    return app


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: Optional[str], insecure: bool) -> None:
    """Listening beyond loopback needs an API key, or an explicit ``insecure``."""
    if not is_loopback(host) and not api_key and not insecure:
        raise UserError(f"refusing to listen on {host} without an API key: anyone who can reach it could use the "
                        "model and write to the preference store; pass --api-key KEY (or set SLM_ALIGN_API_KEY), "
                        "or --insecure to accept that")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line UserError (port in use, unknown address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, reuse_port=False)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UserError(f"cannot listen on {host}:{port} ({reason}); pass another --port or --host") from None


def serve(artifact: Union[str, Path], host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
          insecure: bool = False, log_level: str = "info", announce: Optional[Callable[[dict], None]] = None,
          **options: Any) -> None:
    """Check the address, load the model, listen, and answer until interrupted (Ctrl-C).

    ``options`` go to :func:`create_app`; ``announce`` receives ``{url, model, store, api_key}`` once listening.
    """
    import uvicorn

    check_exposure(host, api_key, insecure)
    sock = bind(host, port)  # before loading the model: a taken port fails fast
    try:
        app = create_app(artifact, api_key=api_key, **options)
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    if announce is not None:
        announce({"url": f"http://{shown}:{bound}/", "model": app.state.service.model.name,
                  "store": str(options.get("store_path")) if options.get("store_path") else None,
                  "api_key": bool(api_key)})
    uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])
