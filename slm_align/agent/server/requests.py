"""Request bodies as pydantic models, and the one function that turns their validation errors into 400s.

Models are strict (a bool is not a number, "1" is not an integer) and read a top-level null as "not given". A chat or
completion request's unknown top-level fields are a 400 naming the field (llama.cpp's ``grammar``, ``reasoning_effort``
and the like would change the answer if honoured) unless they are known to change nothing (:data:`IGNORED`); unknown
keys inside messages and tools are ignored (clients echo back fields of the answers they got).

A body is validated with :func:`validate`, which passes the server's :class:`Limits` as validation context and maps
the first error to the one-line message clients have always received (:func:`to_api_error`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass
from string import Template
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, PydanticKnownError
from starlette.requests import ClientDisconnect, Request

from slm_align.agent.constrain import json_grammar
from slm_align.agent.logprobs import MAX_TOP_LOGPROBS
from slm_align.agent.runtime import fold_seed
from slm_align.agent.sampling import SamplingParams
from slm_align.agent.server.errors import ApiError, bad
from slm_align.agent.store import FEEDBACK_KINDS, MAX_TURN_ID, PREFERRED
from slm_align.errors import UserError
from slm_align.tools.registry import ToolRegistry

ROLES = ("system", "user", "assistant", "tool")
MAX_ARGUMENT_DEPTH = 64
"""Deepest nesting of a past tool call's arguments and of a tool's parameter schema: past it, rendering, checking
the schema and storing would exhaust the stack (jsonschema's own check fails at about 200)."""
MAX_BODY_DEPTH = MAX_ARGUMENT_DEPTH + 8
"""Deepest nesting of a whole body: room for the arguments and schemas, and the messages and tools around them, so
that no other field (a tool's description, a message's name) nests deeper."""
DEFAULTS = SamplingParams()


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


# --- the body as JSON -------------------------------------------------------------------------------------------


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, refused with 413 past ``limit`` bytes (declared or actually sent).

    A body that stops arriving (the connection closed) is a 400 nobody reads, not a traceback. Only
    ``Content-Type: application/json`` is read (415 otherwise): a page on another site can send text/plain
    or form posts to a loopback server without asking, but not JSON.
    """
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the body as JSON with the header 'Content-Type: application/json'")
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
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise bad(f"the body is not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object")
    if _depth(data) > MAX_BODY_DEPTH:
        raise bad(f"the body nests more than {MAX_BODY_DEPTH} levels deep; send flatter tool arguments and schemas")
    return data


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes; send fewer or shorter messages")


# --- validators that need the limits ----------------------------------------------------------------------------


def _limits(info: ValidationInfo) -> Limits:
    return info.context["limits"]


def _at_most_max_tokens(value: int, info: ValidationInfo) -> int:
    if value > _limits(info).max_tokens:
        raise PydanticKnownError("less_than_equal", {"le": _limits(info).max_tokens})
    return value


def _count_at_most(limit_name: str):
    """A before-validator refusing a list longer than the named limit (before its items are looked at)."""
    def check(value: Any, info: ValidationInfo) -> Any:
        limit = getattr(_limits(info), limit_name)
        if isinstance(value, list) and len(value) > limit:
            raise PydanticKnownError("too_long", {"field_type": "List", "max_length": limit,
                                                  "actual_length": len(value)})
        return value
    return BeforeValidator(check)


def _one_of(choices: tuple):
    def check(value: str) -> str:
        if value not in choices:
            raise PydanticCustomError("not_one_of", "must be one of {choices}", {"choices": ", ".join(choices)})
        return value
    return AfterValidator(check)


def _message_sized(text: Optional[str], info: ValidationInfo) -> Optional[str]:
    limit = _limits(info).max_message_chars
    if text is not None and len(text) > limit:
        raise PydanticKnownError("string_too_long", {"max_length": limit})
    return text


Number = Union[StrictInt, StrictFloat]
Tokens = Annotated[StrictInt, Field(ge=1), AfterValidator(_at_most_max_tokens)]
NonEmpty = Annotated[StrictStr, Field(min_length=1)]


class Strict(BaseModel):
    """A JSON object: strict types, unknown keys ignored (request bodies refuse theirs: :func:`refuse_unsupported`)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class Body(Strict):
    """A request body: a top-level null reads as "not given" (the field's default)."""

    @model_validator(mode="before")
    @classmethod
    def _given(cls, data: Any) -> Any:
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


# --- chat -------------------------------------------------------------------------------------------------------


class TextPart(Strict):
    """``{"type": "text", "text"}``: the only content part this model reads."""

    type: Literal["text"]
    text: StrictStr


class CalledFunction(Strict):
    """The function of an assistant's past tool call; ``arguments`` as JSON text (or already an object)."""

    name: StrictStr
    arguments: Any = None


class ToolCall(Strict):
    """One of an assistant's past tool calls (``type`` is not checked)."""

    id: Any = None
    function: CalledFunction


class Message(Strict):
    """One chat message; ``developer`` is read as ``system``, tool calls count on assistant messages only."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(None, validate_default=True)
    content: Union[None, StrictStr, list[TextPart]] = Field(None, validate_default=True)
    tool_calls: Optional[list[ToolCall]] = None
    name: Any = None
    tool_call_id: Any = None

    @field_validator("content", mode="after")
    @classmethod
    def _text(cls, content: Union[None, str, list[TextPart]], info: ValidationInfo) -> str:
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "".join(part.text for part in content)
        return _message_sized(text, info)

    @field_validator("tool_calls", mode="wrap")
    @classmethod
    def _assistants_only(cls, value: Any, handler, info: ValidationInfo) -> Optional[list[ToolCall]]:
        return handler(value) if info.data.get("role") == "assistant" else None


def _schema_depth(schema: Any) -> Any:
    if _depth(schema) > MAX_ARGUMENT_DEPTH:
        raise PydanticCustomError("too_deep", "nests too deeply")
    return schema


class FunctionSpec(Strict):
    """A client tool's function: its name, and a description and JSON schema of any shape."""

    name: StrictStr
    description: Any = None
    parameters: Annotated[Any, AfterValidator(_schema_depth)] = None
    """Its arguments' JSON schema, nesting at most :data:`MAX_ARGUMENT_DEPTH` levels."""


class ToolSpec(Strict):
    """A client-side function tool, as OpenAI's ``tools`` list has them."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(Strict):
    """The function a named ``tool_choice`` asks for."""

    name: StrictStr
    """One of the request's ``tools``."""


class NamedToolChoice(Strict):
    """``{"type": "function", "function": {"name"}}``: the answer is a call of that function."""

    type: Literal["function"] = "function"
    """Always "function"."""
    function: NamedFunction
    """Which function."""


class JsonSchemaFormat(Strict):
    """The ``json_schema`` of a structured-output ``response_format``."""

    name: Any = None
    """The schema's name (not used)."""
    json_schema: dict = Field(alias="schema")
    """The JSON schema the answer follows."""
    strict: Any = None
    """Accepted; the grammar always follows the schema strictly."""
    description: Any = None
    """Not used."""


class ResponseFormat(Strict):
    """``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    """text, json_object or json_schema."""
    json_schema: Optional[JsonSchemaFormat] = None
    """With type json_schema: ``{"name", "schema"}``."""

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticKnownError("missing")
        return self


UNSUPPORTED = {"logit_bias": (None, {}), "functions": (None,), "function_call": (None,), "audio": (None,),
               "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,)}
"""OpenAI request fields that would change the answer and that this server does not implement, with the values
that change nothing (accepted); any other value is a 400 naming the field."""
IGNORED = ("model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
"""Request fields accepted with any value and ignored, because they cannot change the answer: the server serves one
model, records turns only with its own consent setting, and has no tiers or prompt cache. Any other field that a body
does not implement is a 400 naming it."""


def refuse_unsupported(data: Any, unsupported: dict, implemented) -> None:
    """A 400 naming the first field of ``unsupported`` sent with a value that would change the answer, or else the
    first field (not null) that is neither ``implemented`` (the body's own field names), in ``unsupported`` nor in
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
    return bad(f"'{name}' is not supported by this server; leave it out (the answer would silently ignore it)")


class ChatBody(Body):
    """An OpenAI chat completion request; fields are checked in this order (the first error is the answer)."""

    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    """Answers per request: only 1."""
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] = "auto"
    """none (no tools), auto (the model decides), required (calls only) or a named function (that call only)."""
    tools: Annotated[Optional[list[ToolSpec]], _count_at_most("max_tools")] = None
    stream_options: Optional[dict] = None
    messages: Annotated[list[Message], Field(min_length=1), _count_at_most("max_messages")]
    max_completion_tokens: Optional[Tokens] = None
    temperature: Annotated[Number, Field(ge=0, le=2)] = DEFAULTS.temperature
    top_p: Annotated[Number, Field(ge=0, le=1)] = DEFAULTS.top_p
    top_k: Annotated[StrictInt, Field(ge=0)] = DEFAULTS.top_k
    min_p: Annotated[Number, Field(ge=0, le=1)] = DEFAULTS.min_p
    """Drop tokens less likely than this fraction of the likeliest one's probability."""
    repeat_penalty: Annotated[Number, Field(ge=1, le=2)] = DEFAULTS.repeat_penalty
    """llama.cpp's repetition penalty over the last 64 generated tokens (1: off)."""
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] = DEFAULTS.frequency_penalty
    """OpenAI's: minus this times a token's count among the last 64 generated tokens."""
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] = DEFAULTS.presence_penalty
    """OpenAI's: minus this for each token among the last 64 generated tokens."""
    max_tokens: Optional[Tokens] = None
    stop: Annotated[Union[NonEmpty, list[NonEmpty]], _count_at_most("max_stop")] = Field(default_factory=list)
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    include_usage: StrictBool = False
    """``stream_options.include_usage``, lifted here so that it is checked after ``stream``."""
    response_format: Optional[ResponseFormat] = None
    """Structured output: json_object or json_schema (GGUF models; a llama.cpp grammar)."""
    parallel_tool_calls: StrictBool = True
    """False: at most one tool call per answer."""
    logprobs: StrictBool = False
    """Return each answer token's log-probability (not with stream)."""
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    """With logprobs: also the likeliest tokens at each step, this many."""
    x_conversation_id: Optional[Annotated[StrictStr, Field(max_length=128)]] = None
    """Groups the turns of one conversation in the store."""

    @model_validator(mode="before")
    @classmethod
    def _nothing_unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, UNSUPPORTED, cls.model_fields)
        return data

    @model_validator(mode="before")
    @classmethod
    def _lift_include_usage(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        options = data.get("stream_options")
        lifted = options.get("include_usage") if isinstance(options, dict) else None
        body = {key: value for key, value in data.items() if key != "include_usage"}
        if lifted is not None:
            body["include_usage"] = lifted
        return body

    @field_validator("tools", mode="wrap")
    @classmethod
    def _unless_tool_choice_none(cls, value: Any, handler, info: ValidationInfo) -> Optional[list[ToolSpec]]:
        return None if info.data.get("tool_choice") == "none" else handler(value)

    @field_validator("max_tokens", mode="wrap")
    @classmethod
    def _unless_max_completion_tokens(cls, value: Any, handler, info: ValidationInfo) -> Optional[int]:
        return None if info.data.get("max_completion_tokens") is not None else handler(value)

    def sampling(self) -> SamplingParams:
        """Sampling from the request; a missing seed is drawn at random (and recorded with the turn)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty,
                              max_tokens=self.max_completion_tokens or self.max_tokens or DEFAULTS.max_tokens,
                              stop=stop_list(self.stop), seed=request_seed(self.seed))

    def runtime_messages(self) -> list[dict]:
        """The messages as chat templates take them: tool-call arguments as objects, tool results named."""
        call_names: dict = {}
        return [_runtime_message(message, call_names) for message in self.messages]

    def client_tools(self) -> Optional[ToolRegistry]:
        """The request's function tools as a registry that parses the model's calls (the client runs them)."""
        if not self.tools:
            return None
        registry = ToolRegistry()
        for spec in self.tools:
            function = spec.function
            registry.register(_runs_on_the_client, name=function.name,
                              description=function.description or function.name,
                              schema=function.parameters or {"type": "object", "properties": {}})
        return registry


def stop_list(stop: Union[str, list[str]]) -> list[str]:
    """A request's ``stop``, one string or a list, as a list."""
    return [stop] if isinstance(stop, str) else list(stop)


def request_seed(seed: Optional[int]) -> int:
    """A request's ``seed`` folded to 32 bits; a missing one drawn at random (and recorded with the turn)."""
    return secrets.randbits(32) if seed is None else fold_seed(seed)


def _runtime_message(message: Message, call_names: dict) -> dict:
    """One message in the runtime's shape; ``call_names`` maps the call ids seen so far to their functions."""
    role = "system" if message.role == "developer" else message.role
    shaped = {"role": role, "content": message.content}
    if message.tool_calls is not None:
        shaped["tool_calls"] = [{"type": "function", "function": {"name": call.function.name,
                                                                  "arguments": _arguments(call.function.arguments)}}
                                for call in message.tool_calls]
        call_names.update({call.id: call.function.name for call in message.tool_calls if isinstance(call.id, str)})
    if role == "tool":
        named = message.name
        shaped["name"] = named if isinstance(named, str) else call_names.get(message.tool_call_id, "")
    return shaped


def _arguments(arguments: Any) -> Any:
    """OpenAI's JSON-text arguments as the object chat templates take (text that is not JSON stays text); a 400
    when they nest deeper than :data:`MAX_ARGUMENT_DEPTH` (templates and the store recurse into them)."""
    if arguments is None:
        return {}
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        except RecursionError:
            raise _too_deep() from None
    if _depth(value) > MAX_ARGUMENT_DEPTH:
        raise _too_deep()
    return value


def _too_deep() -> ApiError:
    return bad(f"tool call arguments may nest at most {MAX_ARGUMENT_DEPTH} levels deep")


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (counted without recursion)."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _runs_on_the_client(**arguments: Any) -> None:
    """A client-side tool: the server returns the call instead of running it."""
    raise RuntimeError("client-side tools are run by the client")


# --- feedback and alternatives ----------------------------------------------------------------------------------


def _required_for(kind: str):
    """An after-validator: the text must be non-empty when the verdict's kind is ``kind``."""
    def check(text: Optional[str], info: ValidationInfo) -> Optional[str]:
        if info.data.get("kind") == kind and not (text or "").strip():
            raise PydanticKnownError("missing")
        return text
    return AfterValidator(check)


TurnId = Annotated[StrictInt, Field(ge=1, le=MAX_TURN_ID)]
TurnToken = Annotated[StrictStr, Field(min_length=1, max_length=128)]


class FeedbackBody(Body):
    """A verdict on a recorded turn, as the page and API clients send it."""

    kind: Annotated[StrictStr, _one_of(FEEDBACK_KINDS)]
    """up, down, choice or edit."""
    preferred: Annotated[StrictStr, _one_of(PREFERRED)] = "this"
    """choice: which answer won, 'this' (the turn's) or 'other'."""
    turn_id: TurnId
    """The ``x_turn_id`` of the answer."""
    turn_token: TurnToken
    """The ``x_turn_token`` of the answer."""
    text: Annotated[Optional[StrictStr], _required_for("edit"), AfterValidator(_message_sized)] = \
        Field(None, validate_default=True)
    """edit: the corrected answer."""
    other: Annotated[Optional[StrictStr], _required_for("choice"), AfterValidator(_message_sized)] = \
        Field(None, validate_default=True)
    """choice: the other candidate (from /v1/alternative)."""


class AlternativeBody(Body):
    """A request for a second answer to a recorded turn's prompt."""

    turn_id: TurnId
    """The ``x_turn_id`` of the answer."""
    turn_token: TurnToken
    """The ``x_turn_token`` of the answer."""
    seed: Optional[StrictInt] = None
    """The candidate's seed (default: the turn's seed + 1)."""


# --- validation errors as the server's 400s ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """How refusals of one field read: ``'<where>' must be <phrase>[, got <value>]``."""

    phrase: str
    """What the value must be; ``$max_tokens`` and the like name a :class:`Limits` field."""
    got: bool = True
    """Quote the value sent (for type and range errors)."""
    required: Optional[str] = None
    """For a missing value: ``'<where>' is required: <required>``."""
    counted: bool = False
    """A list past its limit: ``'<where>' has N <name>; at most M are accepted``."""


TOOL_SHAPE = '{"type": "function", "function": {"name", "description", "parameters"}}'
CALL_SHAPE = '{"type": "function", "function": {"name", "arguments"}}'
TEXT = Rule("text", required="non-empty text")
RULES = {
    "n": Rule("an integer from 1 to 1"),
    "tools": Rule("a list of function tools", counted=True),
    "tools.*": Rule(TOOL_SHAPE, got=False),
    "tools.*.function.parameters": Rule(f"a JSON schema that nests at most {MAX_ARGUMENT_DEPTH} levels deep",
                                        got=False),
    "stream_options": Rule("an object"),
    "messages": Rule("a non-empty list of {role, content} objects", got=False, counted=True),
    "prompt": Rule("non-empty text (one prompt per request)", required="the text to continue"),
    "messages.*": Rule("an object with a role and content", got=False),
    "messages.*.role": Rule(f"one of {', '.join(ROLES)}"),
    "messages.*.content": Rule("text or a list of text parts (this model reads text only)", got=False),
    "messages.*.tool_calls": Rule("a list of function calls", got=False),
    "messages.*.tool_calls.*": Rule(CALL_SHAPE, got=False),
    "max_completion_tokens": Rule("an integer from 1 to $max_tokens"),
    "temperature": Rule("a number from 0 to 2"),
    "top_p": Rule("a number from 0 to 1"),
    "top_k": Rule("an integer from 0"),
    "tool_choice": Rule('"none", "auto", "required" or {"type": "function", "function": {"name"}}', got=False),
    "min_p": Rule("a number from 0 to 1"),
    "repeat_penalty": Rule("a number from 1 to 2"),
    "frequency_penalty": Rule("a number from -2 to 2"),
    "presence_penalty": Rule("a number from -2 to 2"),
    "response_format": Rule('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                            '{"name", "schema"}}', got=False),
    "parallel_tool_calls": Rule("true or false"),
    "logprobs": Rule("true or false"),
    "top_logprobs": Rule(f"an integer from 0 to {MAX_TOP_LOGPROBS}"),
    "max_tokens": Rule("an integer from 1 to $max_tokens"),
    "stop": Rule("a non-empty string or a list of at most $max_stop of them", got=False),
    "seed": Rule("an integer"),
    "stream": Rule("true or false"),
    "include_usage": Rule("true or false"),
    "x_conversation_id": Rule("text"),
    "kind": Rule(f"one of {', '.join(FEEDBACK_KINDS)}"),
    "preferred": Rule("'this' or 'other'"),
    "turn_id": Rule("an integer from 1 to 2**63-1", required="the x_turn_id of the answer"),
    "turn_token": Rule("text", required="the x_turn_token of the answer"),
    "text": TEXT,
    "other": TEXT,
}
RANGE_ERRORS = ("greater_than_equal", "less_than_equal")
"""Out-of-range values are quoted as Python prints them, wrong types as JSON."""
UNQUOTED_ERRORS = ("missing", "not_one_of")


def to_api_error(exc: ValidationError, limits: Limits) -> ApiError:
    """The 400 for a body that failed validation: the first error, in the words of its field's :data:`RULES`."""
    error = exc.errors(include_url=False)[0]
    key, loc = _rule_for(error["loc"])
    rule = RULES[key]
    where = _where(loc)
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind == "missing" and rule.required:
        return bad(f"{where} is required: {rule.required}")
    if kind == "too_long" and rule.counted:
        return bad(f"{where} has {context['actual_length']} {loc[-1]}; at most {context['max_length']} are accepted")
    if kind == "string_too_long":
        return bad(f"{where} is longer than {context['max_length']} characters")
    refusal = f"{where} must be {Template(rule.phrase).safe_substitute(asdict(limits))}"
    if not rule.got or kind in UNQUOTED_ERRORS:
        return bad(refusal)
    if kind in RANGE_ERRORS:
        return bad(f"{refusal}, got {error['input']}")
    return bad(f"{refusal}, got {json.dumps(error['input'])[:60]}")


def _rule_for(loc: tuple) -> tuple[str, tuple]:
    """The most specific rule for an error's location, and the part of the location it covers."""
    pattern = ["*" if isinstance(part, int) else str(part) for part in loc]
    for end in range(len(loc), 0, -1):
        key = ".".join(pattern[:end])
        if key in RULES:
            return key, tuple(loc[:end])
    raise KeyError(f"no refusal rule for {loc}")


def _where(loc: tuple) -> str:
    """``'field'`` for a top-level field, ``messages[2].content`` inside a list."""
    if not any(isinstance(part, int) for part in loc):
        return f"'{loc[-1]}'"
    where = ""
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        else:
            where += f".{part}" if where else part
    return where


Parsed = TypeVar("Parsed", bound=BaseModel)


def validate(model: type[Parsed], body: dict, limits: Limits) -> Parsed:
    """``body`` as ``model``, or the 400 :func:`to_api_error` makes of its first error."""
    try:
        return model.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        raise to_api_error(exc, limits) from None


# --- the chat request the service answers -----------------------------------------------------------------------


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
    answer_grammar: Optional[str] = None
    """A llama.cpp grammar the answer follows (``tool_choice`` required or named, a JSON ``response_format``)."""
    logprobs: Optional[int] = None
    """Report each token's log-probability with this many alternatives (None: ``logprobs`` not asked for)."""
    single_call: bool = False
    """``parallel_tool_calls`` false: at most one call goes back."""


def parse_chat(body: dict, limits: Limits, backend_kind: str = "gguf") -> ChatRequest:
    """Validate an OpenAI chat completion request; wrong shapes and values, and what ``backend_kind`` cannot do, are
    400s naming the field."""
    chat = validate(ChatBody, body, limits)
    check_combinations(chat)
    tools = chat.client_tools()
    return ChatRequest(messages=chat.runtime_messages(), sampling=chat.sampling(), stream=chat.stream,
                       include_usage=chat.include_usage, client_tools=tools,
                       server_tools=chat.tool_choice != "none" and not _wants_json(chat),
                       conversation_id=chat.x_conversation_id, answer_grammar=answer_grammar(chat, tools, backend_kind),
                       logprobs=_logprobs(chat), single_call=not chat.parallel_tool_calls)


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
        raise bad("'logprobs' is not available with 'stream': true on this server; ask without streaming")
    if _forced_call(chat) and not chat.tools:
        raise bad("'tool_choice' asks for a tool call but the request offers no 'tools'")
    named = chat.tool_choice.function.name if isinstance(chat.tool_choice, NamedToolChoice) else None
    if named is not None and named not in [tool.function.name for tool in chat.tools]:
        raise bad(f"'tool_choice' names the function {named[:64]!r}, which is not among 'tools'")
    if _wants_json(chat) and chat.tools and chat.tool_choice != "none":
        raise bad("'response_format' cannot be combined with 'tools' on this server; send one or the other")


def answer_grammar(chat: ChatBody, tools: Optional[ToolRegistry], backend_kind: str) -> Optional[str]:
    """The grammar that makes the answer a call (``tool_choice``) or JSON (``response_format``); a 400 when the
    backend cannot sample under a grammar."""
    field = "tool_choice" if _forced_call(chat) else "response_format"
    if not (_forced_call(chat) or _wants_json(chat)):
        return None
    if backend_kind != "gguf":
        raise bad(f"'{field}' needs a GGUF model (a llama.cpp grammar constrains the answer); this server runs an "
                  f"{backend_kind.upper()} model: leave '{field}' out, or serve the GGUF export")
    if field == "tool_choice":
        named = chat.tool_choice.function.name if isinstance(chat.tool_choice, NamedToolChoice) else None
        return tools.gbnf_grammar(required=True, names=[named] if named else None)
    schema = chat.response_format.json_schema
    try:
        return json_grammar(schema.json_schema if schema is not None else None)
    except UserError as exc:
        raise bad(f"'response_format': {exc}") from None
