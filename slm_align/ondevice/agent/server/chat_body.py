"""The chat completion request body: messages, tools, tool choice, structured output and
sampling, as pydantic models.

Fields are checked in the order :class:`ChatBody` declares them (the first error is the
answer); a chat request's unknown top-level fields are a 400 naming the field (llama.cpp's
``grammar``, ``reasoning_effort`` and the like would change the answer if honoured) unless they
are known to change nothing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from slm_align.ondevice.agent.logprobs import MAX_TOP_LOGPROBS
from slm_align.ondevice.agent.server.body import (
    MAX_ARGUMENT_DEPTH,
    MAX_SCHEMA_PROPERTIES,
    MAX_SCHEMA_VALUES,
    Body,
    CountAtMost,
    Stop,
    Strict,
    Tokens,
    depth,
    json_values,
    message_sized,
    refuse_unsupported,
    request_seed,
    stop_list,
    widest_properties,
)
from slm_align.ondevice.agent.server.errors import ApiError, bad
from slm_align.ondevice.agent.settings import (
    DEFAULTS,
    FrequencyPenalty,
    MinP,
    PresencePenalty,
    RepeatPenalty,
    SamplingParams,
    Seed,
    Temperature,
    TopK,
    TopP,
)
from slm_align.ondevice.tools.registry import ToolRegistry


class TextPart(Strict):
    """``{"type": "text", "text"}``: the only content part this model reads."""

    model_config = ConfigDict(title="text part")

    type: Literal["text"]
    text: StrictStr


class CalledFunction(Strict):
    """The function of an assistant's past tool call; ``arguments`` as JSON text
    (or already an object)."""

    name: StrictStr
    arguments: Any = None


class ToolCall(Strict):
    """One of an assistant's past tool calls (``type`` is not checked)."""

    model_config = ConfigDict(title="function call")

    id: Any = None
    function: CalledFunction


class Message(Strict):
    """One chat message; ``developer`` is read as ``system``, tool calls count on
    assistant messages only."""

    model_config = ConfigDict(title="message")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(None, validate_default=True)
    content: Union[None, StrictStr, list[TextPart]] = Field(None, validate_default=True)
    tool_calls: Optional[list[ToolCall]] = None
    name: Any = None
    tool_call_id: Optional[StrictStr] = None

    @field_validator("content", mode="after")
    @classmethod
    def _text(cls, content: Union[None, str, list[TextPart]], info: ValidationInfo) -> str:
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "".join(part.text for part in content)
        return message_sized(text, info)

    @field_validator("tool_calls", mode="wrap")
    @classmethod
    def _assistants_only(cls, value: Any, handler, info: ValidationInfo) -> Optional[list[ToolCall]]:
        return handler(value) if info.data.get("role") == "assistant" else None


def _schema_depth(schema: Any) -> Any:
    if depth(schema) > MAX_ARGUMENT_DEPTH:
        raise PydanticCustomError("too_deep", "must be a JSON schema that nests at "
                                              "most {levels} levels deep",
                                  {"levels": MAX_ARGUMENT_DEPTH})
    return schema


def _schema_width(schema: Any) -> Any:
    widest = widest_properties(schema)
    if widest > MAX_SCHEMA_PROPERTIES:
        raise PydanticCustomError("too_wide", "must be a JSON schema whose objects have at most {limit} "
                                              "properties; one has {found}",
                                  {"limit": MAX_SCHEMA_PROPERTIES, "found": widest})
    return schema


def _schema_values(schema: Any) -> Any:
    count = json_values(schema)
    if count > MAX_SCHEMA_VALUES:
        raise PydanticCustomError("too_many_values", "must be a JSON schema of at most {limit} JSON values; "
                                                     "it has {found}", {"limit": MAX_SCHEMA_VALUES, "found": count})
    return schema


def _tool_schema_values(tools: Optional[list["ToolSpec"]]) -> Optional[list["ToolSpec"]]:
    """The request's tools, unless their parameter schemas together hold more than :data:`MAX_SCHEMA_VALUES`
    JSON values (checking them and building their grammar would take long)."""
    count = sum(json_values(tool.function.parameters) for tool in tools or ())
    if count > MAX_SCHEMA_VALUES:
        raise PydanticCustomError("too_many_values", "hold {found} JSON values in their parameter schemas; "
                                                     "at most {limit} are accepted",
                                  {"limit": MAX_SCHEMA_VALUES, "found": count})
    return tools


class FunctionSpec(Strict):
    """A client tool's function: its name, and a description and JSON schema of any shape."""

    name: StrictStr
    description: Any = None
    parameters: Annotated[Any, AfterValidator(_schema_depth), AfterValidator(_schema_width)] = None
    """Its arguments' JSON schema: nesting at most :data:`MAX_ARGUMENT_DEPTH` levels, at most
    :data:`MAX_SCHEMA_PROPERTIES` properties to an object (and the request's tools together hold at most
    :data:`MAX_SCHEMA_VALUES` JSON values in theirs)."""


class ToolSpec(Strict):
    """A client-side function tool, as OpenAI's ``tools`` list has them."""

    model_config = ConfigDict(title="function tool")

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
    json_schema: Annotated[dict, AfterValidator(_schema_depth), AfterValidator(_schema_width),
                           AfterValidator(_schema_values)] = Field(alias="schema")
    """The JSON schema the answer follows: as deep, as wide and as large as a tool's may be."""
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
            raise PydanticCustomError("schema_missing", 'with "type": "json_schema" needs '
                                      '"json_schema": {"name", "schema"}')
        return self


UNSUPPORTED = {"logit_bias": (None, {}), "functions": (None,), "function_call": (None,), "audio": (None,),
               "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,)}
"""OpenAI request fields that would change the answer and that this server does not implement, with
the values that change nothing (accepted); any other value is a 400 naming the field."""


class ChatBody(Body):
    """An OpenAI chat completion request; fields are checked in this order (the
    first error is the answer)."""

    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    """Answers per request: only 1."""
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] = "auto"
    """none (no tools), auto (the model decides), required (calls only) or a named
    function (that call only)."""
    tools: Annotated[Optional[list[ToolSpec]], CountAtMost("max_tools"), AfterValidator(_tool_schema_values)] = None
    stream_options: Optional[dict] = None
    messages: Annotated[list[Message], Field(min_length=1), CountAtMost("max_messages")]
    max_completion_tokens: Optional[Tokens] = None
    temperature: Temperature = DEFAULTS.temperature
    top_p: TopP = DEFAULTS.top_p
    top_k: TopK = DEFAULTS.top_k
    min_p: MinP = DEFAULTS.min_p
    repeat_penalty: RepeatPenalty = DEFAULTS.repeat_penalty
    frequency_penalty: FrequencyPenalty = DEFAULTS.frequency_penalty
    presence_penalty: PresencePenalty = DEFAULTS.presence_penalty
    max_tokens: Optional[Tokens] = None
    stop: Stop = Field(default_factory=list)
    seed: Optional[Seed] = None
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
        """Sampling from the request; a missing seed is drawn at random (and
        recorded with the turn)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty,
                              max_tokens=self.max_completion_tokens or self.max_tokens or DEFAULTS.max_tokens,
                              stop=stop_list(self.stop), seed=request_seed(self.seed))

    def runtime_messages(self) -> list[dict]:
        """The messages as chat templates take them: tool-call arguments as
        objects, tool results named."""
        call_names: dict = {}
        return [_runtime_message(message, call_names) for message in self.messages]

    def client_tools(self) -> Optional[ToolRegistry]:
        """The request's function tools as a registry that parses the model's calls
        (the client runs them)."""
        if not self.tools:
            return None
        registry = ToolRegistry()
        for spec in self.tools:
            function = spec.function
            registry.register(_runs_on_the_client, name=function.name,
                              description=function.description or function.name,
                              schema=function.parameters or {"type": "object", "properties": {}})
        return registry


def _runtime_message(message: Message, call_names: dict) -> dict:
    """One message in the runtime's shape; ``call_names`` maps the call ids seen so
    far to their functions."""
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
    """OpenAI's JSON-text arguments as the object chat templates take (text that is not JSON
    stays text); a 400 when they nest deeper than :data:`MAX_ARGUMENT_DEPTH` (templates and the
    store recurse into them)."""
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
    if depth(value) > MAX_ARGUMENT_DEPTH:
        raise _too_deep()
    return value


def _too_deep() -> ApiError:
    return bad(f"tool call arguments may nest at most {MAX_ARGUMENT_DEPTH} levels deep")


def _runs_on_the_client(**arguments: Any) -> None:
    """A client-side tool: the server returns the call instead of running it."""
    raise RuntimeError("client-side tools are run by the client")
