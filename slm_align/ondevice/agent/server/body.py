"""A request body: read as JSON within the server's :class:`Limits`, and the pydantic ground
every body model stands on.

Models are strict (a bool is not a number, "1" is not an integer) and read a top-level null as
"not given". Unknown top-level fields are a 400 naming the field unless they are known to change
nothing (:data:`IGNORED`); unknown keys inside messages and tools are ignored (clients echo back
fields of the answers they got).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationInfo, model_validator
from pydantic_core import PydanticKnownError, core_schema
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from slm_align.ondevice.agent.runtime import fold_seed
from slm_align.ondevice.agent.server.errors import ApiError, bad
from slm_align.ondevice.agent.settings import MaxTokens

MAX_ARGUMENT_DEPTH = 64
"""Deepest nesting of a past tool call's arguments and of a tool's parameter schema: past
it, rendering, checking the schema and storing would exhaust the stack (jsonschema's own
check fails at about 200)."""
MAX_BODY_DEPTH = MAX_ARGUMENT_DEPTH + 8
"""Deepest nesting of a whole body: room for the arguments and schemas, and the messages and tools
around them, so that no other field (a tool's description, a message's name) nests deeper."""
MAX_SCHEMA_VALUES = 4096
"""Most JSON values (objects, arrays, strings, numbers, ...) in a chat request's schemas together: its
tools' parameters, or its ``response_format`` schema. Checking schemas and building their grammars
take time in proportion (about 0.4 s for this many), and more would not fit a small model's context."""
MAX_SCHEMA_PROPERTIES = 256
"""Most properties of one object in a schema: llama.cpp's converter of a ``response_format``
schema takes time quadratic in them (about 1 s for 900)."""


@dataclass
class Limits:
    """What one request may ask of the server; beyond it the answer is a 4xx (or
    503) and serving goes on."""

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


# --- the body as JSON -----------------------------------------------------------------------------


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, refused with 413 past ``limit`` bytes (declared or actually sent).

    A body that stops arriving (the connection closed) is a 400 nobody reads, not a traceback. Only
    ``Content-Type: application/json`` is read (415 otherwise): a page on another site can send
    text/plain or form posts to a loopback server without asking, but not JSON. The body is decoded
    and checked on a worker thread: a megabyte of tiny values takes a third of a second, which the
    event loop (and every other client) would otherwise wait out.
    """
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the body as JSON with the header "
                            "'Content-Type: application/json'")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:  # the client left, or was too slow (connections.RequestDeadline): nobody reads this
        raise bad("the connection closed before the whole body arrived") from None
    return await run_in_threadpool(decode_json, bytes(body))


def decode_json(body: bytes) -> dict:
    """``body`` as a JSON object of valid Unicode nesting at most :data:`MAX_BODY_DEPTH` levels, or a 400."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise bad(f"the body is not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object")
    if not encodable(data):
        raise bad("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is no character; send valid "
                  "Unicode text")
    if depth(data) > MAX_BODY_DEPTH:
        raise bad(f"the body nests more than {MAX_BODY_DEPTH} levels deep; send flatter tool "
                  f"arguments and schemas")
    return data


def encodable(data: Any) -> bool:
    """Whether every string of ``data`` is valid Unicode: ``json.loads`` lets lone surrogates through, escaped
    (``\\ud800``) or as raw bytes (ED A0 80), and they fail later, wherever the text is encoded."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes; send "
                         "fewer or shorter messages")


def nested(value: Any) -> Iterator[Any]:
    """``value`` and every object, array and scalar within it (walked without recursion)."""
    pending = [value]
    while pending:
        item = pending.pop()
        yield item
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def json_values(value: Any) -> int:
    """How many JSON values ``value`` holds, itself and every object, array and scalar within."""
    return sum(1 for _ in nested(value))


def widest_properties(schema: Any) -> int:
    """The most ``properties`` that one object of the JSON schema ``schema`` declares."""
    widths = [len(item["properties"]) for item in nested(schema)
              if isinstance(item, dict) and isinstance(item.get("properties"), dict)]
    return max(widths, default=0)


def depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (counted without recursion)."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


# --- validators that need the limits --------------------------------------------------------------


def _limits(info: ValidationInfo) -> Limits:
    return info.context["limits"]


@dataclass(frozen=True)
class AtMost:
    """``Annotated`` metadata: a value at most the server's :class:`Limits` field
    ``limit`` (``le`` there)."""

    limit: str

    def bounds(self, limits: Limits) -> dict:
        """The constraint as :mod:`slm_align.ondevice.agent.bounds` names it."""
        return {"le": getattr(limits, self.limit)}

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.with_info_after_validator_function(self._check, handler(source))

    def _check(self, value: Any, info: ValidationInfo) -> Any:
        limit = getattr(_limits(info), self.limit)
        if value > limit:
            raise PydanticKnownError("less_than_equal", {"le": limit})
        return value


@dataclass(frozen=True)
class CountAtMost:
    """``Annotated`` metadata: a list of at most the server's :class:`Limits` field ``limit`` items,
    refused before its items are looked at (``max_length`` there)."""

    limit: str

    def bounds(self, limits: Limits) -> dict:
        """The constraint as :mod:`slm_align.ondevice.agent.bounds` names it."""
        return {"max_length": getattr(limits, self.limit)}

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.with_info_before_validator_function(self._check, handler(source))

    def _check(self, value: Any, info: ValidationInfo) -> Any:
        limit = getattr(_limits(info), self.limit)
        if isinstance(value, list) and len(value) > limit:
            raise PydanticKnownError("too_long", {"field_type": "List", "max_length": limit,
                                                  "actual_length": len(value)})
        return value


def message_sized(text: Optional[str], info: ValidationInfo) -> Optional[str]:
    limit = _limits(info).max_message_chars
    if text is not None and len(text) > limit:
        raise PydanticKnownError("string_too_long", {"max_length": limit})
    return text


Tokens = Annotated[MaxTokens, AtMost("max_tokens")]
"""``max_tokens``: as many as ``chat --max-new-tokens`` takes, within the server's limit."""
NonEmpty = Annotated[StrictStr, Field(min_length=1)]
Stop = Union[NonEmpty, Annotated[list[NonEmpty], CountAtMost("max_stop")]]
"""``stop``: one string, or a list of at most the server's limit."""


class Strict(BaseModel):
    """A JSON object: strict types, unknown keys ignored (request bodies refuse theirs:
    :func:`refuse_unsupported`)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class Body(Strict):
    """A request body: a top-level null reads as "not given" (the field's default)."""

    @model_validator(mode="before")
    @classmethod
    def _given(cls, data: Any) -> Any:
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


# --- fields a body does not implement -------------------------------------------------------------


IGNORED = ("model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
"""Request fields accepted with any value and ignored, because they cannot change the answer: the
server serves one model, records turns only with its own consent setting, and has no tiers or prompt
cache. Any other field that a body does not implement is a 400 naming it."""


def refuse_unsupported(data: Any, unsupported: dict, implemented) -> None:
    """A 400 naming the first field of ``unsupported`` sent with a value that would change the
    answer, or else the first field (not null) that is neither ``implemented`` (the body's own field
    names), in ``unsupported`` nor in
    :data:`IGNORED`."""
    if not isinstance(data, dict):
        return
    for name, harmless in unsupported.items():
        if name in data and data[name] not in harmless:
            raise _not_supported(name)
    for name, value in data.items():
        known = name in implemented or name in unsupported or name in IGNORED
        if not known and value is not None:
            raise _not_supported(str(name)[:64])


def _not_supported(name: str) -> ApiError:
    return bad(f"'{name}' is not supported by this server; leave it out (the answer "
               "would silently ignore it)")


# --- fields every sampling body shares ------------------------------------------------------------


def stop_list(stop: Union[str, list[str]]) -> list[str]:
    """A request's ``stop``, one string or a list, as a list."""
    return [stop] if isinstance(stop, str) else list(stop)


def request_seed(seed: Optional[int]) -> int:
    """A request's ``seed`` folded to 32 bits; a missing one drawn at random (and
    recorded with the turn)."""
    return secrets.randbits(32) if seed is None else fold_seed(seed)

