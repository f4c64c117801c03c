"""Tools the on-device agent can call: declare, describe, parse, execute, constrain.

A tool is a plain Python function. :class:`ToolRegistry` turns its type hints and docstring into a
JSON schema, lists the tools in the OpenAI format that chat templates (Qwen2.5, Llama 3, ...) expect,
finds tool calls in the model's reply, runs them, and writes a llama.cpp GBNF grammar that keeps a
reply to either free text or one well-formed call.

The tool-call text format is the Hermes / Qwen2.5 one::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2*(3+4)"}}
    </tool_call>

(one or several blocks), SmolLM2's list form ``<tool_call>[{"name": ...}, {"name": ...}]</tool_call>`` (several calls
in one block, as are several objects one after another), or a bare ``{"name": ..., "arguments": {...}}`` object (or a
list of them) as the whole reply.

Bad input while *registering* a tool raises a one-line :class:`~slm_align.errors.UserError`.
Anything that goes wrong while *running* (malformed JSON, an unknown tool, arguments that break the
schema, a tool that raises) becomes an :class:`Observation` with ``ok=False`` and a short message
the model can read and act on; nothing here raises at run time.

Stdlib and jsonschema only: this module runs on phones and boards.
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

import jsonschema

from slm_align.errors import UserError

DEFAULT_MAX_OBSERVATION_CHARS = 2000

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
_SIMPLE_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number"}
_SUPPORTED = "str, int, float, bool, list[...], dict[str, ...], Optional[...], Literal[...] or an Enum"


@dataclass
class Tool:
    """A callable tool: its name, one-line description, JSON schema of its arguments, and the function."""

    name: str
    description: str
    parameters: dict
    function: Callable[..., Any]

    def spec(self) -> dict:
        """The OpenAI-style tool dict: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolCall:
    """One call the model asked for: a registered tool's name and its (not yet validated) arguments."""

    name: str
    arguments: dict

    def as_dict(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (the shape chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Observation:
    """What a call produced. ``content`` is the text to show the model; on failure it starts with "Error:"."""

    name: str
    ok: bool
    content: str
    error: Optional[str] = None

    @classmethod
    def failure(cls, name: str, message: str) -> "Observation":
        """A failed call: the message is both ``error`` and, prefixed with "Error: ", ``content``."""
        return cls(name=name, ok=False, content=f"Error: {message}", error=message)

    def as_message(self) -> dict:
        """The observation as a ``{"role": "tool", ...}`` chat message."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass
class ParsedCalls:
    """A reply split into tool calls, the text outside them, and failed calls.

    Each failed call is an ``ok=False`` :class:`Observation` to hand back to the model like a tool's
    result; its ``name`` is the tool name it asked for, or "" when none could be read.
    """

    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    errors: list[Observation] = field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        """True when the reply tried to call a tool, successfully or not."""
        return bool(self.calls or self.errors)


# --- schema from a function -------------------------------------------------------------------


def function_schema(fn: Callable, name: str) -> tuple[str, dict]:
    """The docstring's first line and the JSON schema of ``fn``'s parameters, from its type hints."""
    summary, arg_docs = _docstring_parts(fn)
    hints = _type_hints(fn, name)
    properties = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool {name!r}, parameter {param.name!r}"
        _check_parameter_kind(param, where)
        if param.name not in hints:
            raise UserError(f"{where} has no type annotation: annotate it with {_SUPPORTED}")
        prop = annotation_schema(hints[param.name], where)
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        elif _json_default(param.default) is not None:
            prop["default"] = _json_default(param.default)[0]
        properties[param.name] = prop
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return summary, schema


def annotation_schema(annotation: Any, where: str = "annotation") -> dict:
    """The JSON schema of one type annotation; an unsupported one is a UserError naming ``where``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[annotation]}
    if annotation is type(None):
        return {"type": "null"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_schema([member.value for member in annotation], where)
    if origin is Literal:
        return _enum_schema(list(args), where)
    if origin is Union or origin is types.UnionType:
        return _union_schema([annotation_schema(arg, where) for arg in args])
    if annotation is list or origin is list:
        return {"type": "array", **({"items": annotation_schema(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        return _dict_schema(args, where)
    raise UserError(f"{where}: type {_type_name(annotation)} is not supported; use {_SUPPORTED}")


def _type_hints(fn: Callable, name: str) -> dict:
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:  # a forward reference that does not resolve
        raise UserError(f"tool {name!r}: cannot read its type hints ({exc})") from None


def _check_parameter_kind(param: inspect.Parameter, where: str) -> None:
    if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
        raise UserError(f"{where}: *args, **kwargs and positional-only parameters cannot be tool arguments")


def _json_type(value: Any) -> Optional[str]:
    if value is None:
        return "null"
    return _SIMPLE_TYPES.get(type(value))


def _enum_schema(values: list, where: str) -> dict:
    kinds = {_json_type(value) for value in values}
    if None in kinds:
        raise UserError(f"{where}: choices must be str, int, float, bool or None, got {values!r}")
    return {"type": kinds.pop(), "enum": values} if len(kinds) == 1 else {"enum": values}


def _union_schema(options: list[dict]) -> dict:
    if all(set(option) == {"type"} for option in options):
        return {"type": [option["type"] for option in options]}
    return {"anyOf": options}


def _dict_schema(args: tuple, where: str) -> dict:
    if not args:
        return {"type": "object"}
    if args[0] is not str:
        raise UserError(f"{where}: dictionary keys must be str (JSON object keys), got {_type_name(args[0])}")
    return {"type": "object", "additionalProperties": annotation_schema(args[1], where)}


def _json_default(value: Any) -> Optional[tuple]:
    """``(value,)`` when the default can be shown in the schema, else None."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or type(value) in _SIMPLE_TYPES:
        return (value,)
    return None


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or repr(annotation)


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """The docstring's first line and the per-parameter text of a Google-style "Args:" section."""
    lines = (inspect.getdoc(fn) or "").splitlines()
    summary = lines[0].strip() if lines else ""
    return summary, _args_section(lines)


_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _args_section(lines: list[str]) -> dict[str, str]:
    docs: dict[str, str] = {}
    inside = False
    indent = None
    current = None
    for line in lines:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # a section header, or text outside any section
            inside = line.strip() in ("Args:", "Arguments:")
            indent = None
            current = None
            continue
        if not inside:
            continue
        indent = depth if indent is None else indent
        match = _ARG_LINE.match(line.strip())
        if depth == indent and match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current:
            docs[current] = f"{docs[current]} {line.strip()}".strip()
    return docs


def _accepting_enum_values(fn: Callable) -> Callable:
    """Wrap ``fn`` so parameters annotated with an Enum receive the member, not the raw JSON value."""
    hints = typing.get_type_hints(fn)
    enums = {k: v for k, v in hints.items() if isinstance(v, type) and issubclass(v, enum.Enum) and k != "return"}
    if not enums:
        return fn

    @functools.wraps(fn)
    def call(**arguments):
        for key, enum_type in enums.items():
            if key in arguments:
                arguments[key] = enum_type(arguments[key])
        return fn(**arguments)

    return call


# --- the registry -----------------------------------------------------------------------------


class ToolRegistry:
    """The tools an agent may call, with everything needed to offer, parse, run and constrain them.

    Args:
        max_observation_chars: Longest observation content handed back to the model; longer
            results are cut and marked as truncated.
    """

    def __init__(self, max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS):
        if max_observation_chars < 40:
            raise UserError(f"max_observation_chars must be at least 40, got {max_observation_chars}")
        self.max_observation_chars = max_observation_chars
        self._tools: dict[str, Tool] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}

    # registration

    def register(
        self,
        fn: Optional[Callable] = None,
        *,
        name: Optional[str] = None,
        description: Optional[str] = None,
        schema: Optional[dict] = None,
    ):
        """Add ``fn`` as a tool; returns ``fn``. Usable as ``@registry.register`` or ``@registry.register(name=...)``.

        Args:
            fn: The function. Its parameters become the tool's arguments.
            name: Tool name (default: the function's name); letters, digits, "_" and "-".
            description: What the tool does (default: the docstring's first line).
            schema: JSON schema of the arguments (default: derived from the type hints and defaults,
                with per-parameter descriptions from a Google-style "Args:" docstring section).

        Raises:
            UserError: a bad name, a duplicate, no description, an unsupported annotation or an
                invalid schema.
        """
        if fn is None:
            return functools.partial(self.register, name=name, description=description, schema=schema)
        tool_name = name or getattr(fn, "__name__", "")
        self._check_name(tool_name)
        if schema is None:
            summary, parameters = function_schema(fn, tool_name)
            function = _accepting_enum_values(fn)
        else:
            summary = _docstring_parts(fn)[0]
            parameters = schema
            function = fn
        tool = Tool(tool_name, description or summary, parameters, function)
        if not tool.description:
            raise UserError(f"tool {tool_name!r} has no description: give the function a docstring "
                            "or pass description=")
        self._validators[tool_name] = _validator(tool)
        self._tools[tool_name] = tool
        return fn

    def _check_name(self, name: str) -> None:
        if not _NAME.match(name):
            raise UserError(f"tool name {name!r} is invalid: use 1-64 letters, digits, '_' or '-', "
                            "starting with a letter or '_'")
        if name in self._tools:
            raise UserError(f"a tool named {name!r} is already registered: "
                            "pass name= to register it under another name")

    # lookup

    @property
    def names(self) -> list[str]:
        """Registered tool names, in registration order."""
        return list(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Optional[Tool]:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def specs(self) -> list[dict]:
        """OpenAI-style tool dicts, the ``tools=`` argument of chat templates and OpenAI clients."""
        return [tool.spec() for tool in self._tools.values()]

    # parsing

    def parse_calls(self, text: str) -> ParsedCalls:
        """Find tool calls in a model reply; never raises.

        Recognises ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (one or several;
        a last block whose closing tag was cut off still counts), a block holding a list of calls
        (SmolLM2) or several call objects, and a bare ``{"name": ..., "arguments": ...}`` object or
        list of them as the whole reply. ``text`` is the reply without the blocks. Bad JSON, an unknown
        tool or arguments that are not an object land in ``errors`` as failed observations.
        """
        if "<tool_call>" in text:
            parts = _TOOL_CALL_BLOCK.split(text)  # text, call body, text, call body, ..., text
            parsed = ParsedCalls(text="\n".join(part.strip() for part in parts[0::2] if part.strip()))
            for body in parts[1::2]:
                for decoded in _decode_calls(_unfence(body.strip())):
                    self._collect(parsed, decoded)
            return parsed
        bare = _bare_calls(text)
        if bare is None:
            return ParsedCalls(text=text.strip())
        parsed = ParsedCalls()
        for decoded in bare:
            self._collect(parsed, decoded)
        return parsed

    def _collect(self, parsed: ParsedCalls, decoded: Any) -> None:
        """File a decoded call (or the observation saying why it could not be decoded)."""
        outcome = decoded if isinstance(decoded, Observation) else self._to_call(decoded)
        if isinstance(outcome, Observation):
            parsed.errors.append(self._failure(outcome.name, outcome.error))
        else:
            parsed.calls.append(outcome)

    def _to_call(self, obj: Any) -> Union[ToolCall, Observation]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return Observation.failure("", "a tool call must be a JSON object with a \"name\" and \"arguments\"; "
                                       f"{_FORMAT_HINT}")
        name = obj["name"]
        if name not in self._tools:
            return Observation.failure(name, self._unknown_tool(name))
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # OpenAI clients send arguments as a JSON string
            arguments = _decode(arguments)
        if not isinstance(arguments, dict):
            return Observation.failure(name, f"\"arguments\" of {name} must be a JSON object "
                                             f"such as {self._example(name)}")
        return ToolCall(name=name, arguments=arguments)

    # execution

    def execute(self, call: ToolCall) -> Observation:
        """Validate ``call``'s arguments against the schema and run the tool; never raises.

        A result is turned into text (``json.dumps`` for dicts, lists and tuples, ``str`` otherwise) and
        cut to ``max_observation_chars``. An unknown tool, invalid arguments or an exception raised by
        the tool give ``ok=False`` with a short message. (KeyboardInterrupt and SystemExit still propagate.)
        """
        tool = self._tools.get(call.name)
        if tool is None:
            return self._failure(call.name, self._unknown_tool(call.name))
        try:
            problem = self._argument_problem(tool, call.arguments)
            if problem:
                return self._failure(tool.name, problem)
            text = _to_text(tool.function(**call.arguments))
        except Exception as exc:
            return self._failure(tool.name, f"{tool.name} failed: {_exception_text(exc)}")
        return Observation(name=tool.name, ok=True, content=self._capped(text))

    def _argument_problem(self, tool: Tool, arguments: Any) -> Optional[str]:
        if not isinstance(arguments, dict):
            return f"arguments of {tool.name} must be a JSON object such as {self._example(tool.name)}"
        error = jsonschema.exceptions.best_match(self._validators[tool.name].iter_errors(arguments))
        if error is None:
            return None
        where = "".join(f"[{part!r}]" for part in error.absolute_path)
        return f"invalid arguments for {tool.name}{where}: {error.message}; expected {_signature(tool)}"

    def _failure(self, name: str, message: str) -> Observation:
        observation = Observation.failure(name, message)
        observation.content = self._capped(observation.content)
        return observation

    def _capped(self, text: str) -> str:
        limit = self.max_observation_chars
        if len(text) <= limit:
            return text
        marker = f" ... [truncated {len(text)} characters to {limit}]"
        return text[: limit - len(marker)] + marker

    def _unknown_tool(self, name: str) -> str:
        return f"unknown tool {name!r}; available tools: {', '.join(self._tools) or 'none'}"

    def _example(self, name: str) -> str:
        properties = self._tools[name].parameters.get("properties", {})
        return json.dumps({key: f"<{_type_word(schema)}>" for key, schema in properties.items()})

    # grammar

    def gbnf_grammar(self, required: bool = False, names: Optional[list[str]] = None) -> str:
        """A llama.cpp GBNF grammar: the reply is free text or ``<tool_call>`` blocks following the schemas.

        Free text may not start a tag (``<`` followed by a letter or ``/``), so a reply that calls a
        tool must use the grammar's path, where the name is one of the registered tools and the
        arguments are a JSON object with the schema's properties in order (optional ones may be
        left out). Schema keywords the grammar cannot express (minimum, pattern, ...) are left to
        :meth:`execute`'s validation. ``required``: calls only, no free text (OpenAI's ``tool_choice``
        "required"), written compactly (at most one space between tokens: a small model pushed into a
        call otherwise wanders off in whitespace); ``names``: only these tools may be called (a named
        ``tool_choice``).
        """
        tools = [tool for name, tool in self._tools.items() if names is None or name in names]
        return _GrammarBuilder().build(tools, free_text=not required, compact=required)


def _validator(tool: Tool):
    if not isinstance(tool.parameters, dict) or tool.parameters.get("type") != "object":
        raise UserError(f"tool {tool.name!r}: the schema must be a JSON object schema with \"type\": \"object\"")
    validator_class = jsonschema.validators.validator_for(tool.parameters)
    try:
        validator_class.check_schema(tool.parameters)
    except jsonschema.exceptions.SchemaError as exc:
        raise UserError(f"tool {tool.name!r}: invalid JSON schema: {exc.message}") from None
    return validator_class(tool.parameters)


def _type_word(schema: dict) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type", "any")
    return "/".join(kind) if isinstance(kind, list) else kind


def _signature(tool: Tool) -> str:
    required = set(tool.parameters.get("required", ()))
    parts = [
        f"{key}: {_type_word(schema)}{'' if key in required else ' (optional)'}"
        for key, schema in tool.parameters.get("properties", {}).items()
    ]
    return f"{tool.name}({', '.join(parts)})"


def _exception_text(exc: Exception) -> str:
    """A ValueError is a tool's way to say "your input is wrong": its message alone; others keep their type."""
    return str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"


def _to_text(result: Any) -> str:
    if isinstance(result, (dict, list, tuple)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)


# --- parsing helpers --------------------------------------------------------------------------

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCED = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_FORMAT_HINT = 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


def _unfence(text: str) -> str:
    match = _FENCED.match(text)
    return match.group(1) if match else text


def _decode(text: str) -> Union[Any, Observation]:
    """The JSON value in ``text``, or a failed observation saying why it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return Observation.failure("", f"malformed JSON in tool call ({exc.msg} at character {exc.pos}); "
                                   f"{_FORMAT_HINT}")


def _decode_calls(text: str) -> list:
    """The calls of one block: a call object, a list of them (SmolLM2's form), or several objects one after another
    (each still to be checked); a failed observation when the block is not JSON."""
    decoder = json.JSONDecoder()
    values = []
    position = 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return [_decode(text)]
        values.extend(value if isinstance(value, list) and value else [value])
        position = len(text) - len(text[end:].lstrip())
    return values or [_decode(text)]


def _is_call(obj: Any) -> bool:
    return isinstance(obj, dict) and ("arguments" in obj or "parameters" in obj)


def _looks_like_calls(obj: Any) -> bool:
    """A call object, or a non-empty list of them."""
    if isinstance(obj, list):
        return bool(obj) and all(_is_call(item) for item in obj)
    return _is_call(obj)


def _bare_calls(text: str) -> Optional[list]:
    """A whole reply that is a ``{"name": ..., "arguments": ...}`` object or a list of them; None for ordinary
    text."""
    candidate = _unfence(text.strip())
    bracketed = candidate[:1] + candidate[-1:] in ("{}", "[]")
    if not (bracketed and '"name"' in candidate):
        return None
    decoded = _decode(candidate)
    if isinstance(decoded, Observation):  # looks like a call ("name" and "arguments") but is broken
        return [decoded] if '"arguments"' in candidate else None
    if not _looks_like_calls(decoded):
        return None
    return decoded if isinstance(decoded, list) else [decoded]


# --- GBNF -------------------------------------------------------------------------------------

# Generic JSON, after llama.cpp's grammars/json.gbnf; rules for each tool are added after these.
_JSON_RULES = {
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* ws )? "}"',
    "array": '"[" ws ( value ( ws "," ws value )* ws )? "]"',
    "string": r'"\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""',
    "number": 'integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?',
    "integer": '"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "boolean": '"true" | "false"',
    "null": '"null"',
    "ws": '| " " | "\\n" [ \\t]{0,20}',
}
_TYPE_RULES = {"string", "number", "integer", "boolean", "null"}
_COMPACT_WS = '| " "'
"""Whitespace of a compact grammar: none or one space."""


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


class _GrammarBuilder:
    """Collects named GBNF rules; ``value`` turns a JSON schema into a rule expression."""

    def __init__(self):
        self.rules: dict[str, str] = {}

    def add(self, hint: str, body: str) -> str:
        """Add a rule with a name derived from ``hint`` (made unique) and return the name."""
        base = re.sub(r"[^A-Za-z0-9]+", "-", hint).strip("-").lower() or "rule"
        name = base
        n = 1
        while name in self.rules or name in _JSON_RULES or name == "root":
            n += 1
            name = f"{base}-{n}"
        self.rules[name] = body
        return name

    def build(self, tools: list[Tool], free_text: bool = True, compact: bool = False) -> str:
        self.add("text-char", '[^<] | "<" [^A-Za-z/<]')
        self.add("free-text", "text-char+")
        root = "free-text"
        if tools:
            branches = " | ".join(self._call_branch(tool) for tool in tools)
            call = self.add(
                "tool-call",
                f'"<tool_call>" "\\n"? "{{" ws "\\"name\\"" ws ":" ws ( {branches} ) ws "}}" "\\n"? "</tool_call>"',
            )
            calls = f'{call} ( "\\n" {call} )*'
            root = f"{calls} | free-text" if free_text else calls
        json_rules = {**_JSON_RULES, "ws": _COMPACT_WS} if compact else _JSON_RULES
        lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in {**self.rules, **json_rules}.items()]
        return "\n".join(lines) + "\n"

    def _call_branch(self, tool: Tool) -> str:
        arguments = self.value(tool.parameters, f"{tool.name}-args")
        body = f'{_literal(json.dumps(tool.name))} ws "," ws "\\"arguments\\"" ws ":" ws {arguments}'
        return self.add(f"call-{tool.name}", body)

    def value(self, schema: Any, hint: str) -> str:
        """A GBNF expression for JSON values that follow ``schema`` (generic JSON where it cannot tell)."""
        if not isinstance(schema, dict):
            return "value"
        if "const" in schema:
            return _literal(json.dumps(schema["const"]))
        if "enum" in schema:
            return "( " + " | ".join(_literal(json.dumps(item)) for item in schema["enum"]) + " )"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = (self.value(option, f"{hint}-{i}") for i, option in enumerate(schema[key]))
                return "( " + " | ".join(options) + " )"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "( " + " | ".join(self.value({**schema, "type": one}, f"{hint}-{one}") for one in kind) + " )"
        if kind in _TYPE_RULES:
            return kind
        if kind == "array":
            return self._array(schema, hint)
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self._object(schema, hint)
        if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
            return self._map(schema["additionalProperties"], hint)
        return "object" if kind == "object" else "value"

    def _array(self, schema: dict, hint: str) -> str:
        item = self.value(schema.get("items"), f"{hint}-item")
        return self.add(hint, f'"[" ws ( {item} ( ws "," ws {item} )* ws )? "]"')

    def _map(self, value_schema: dict, hint: str) -> str:
        entry = self.add(f"{hint}-entry", f'string ws ":" ws {self.value(value_schema, f"{hint}-value")}')
        return self.add(hint, f'"{{" ws ( {entry} ( ws "," ws {entry} )* ws )? "}}"')

    def _object(self, schema: dict, hint: str) -> str:
        """Properties in schema order; required ones always, optional ones maybe, commas between.

        Built from the last property backwards: ``unwritten`` matches the members from the current one
        on when none was written yet, ``written`` the same when one was (so each starts with a comma).
        """
        required = set(schema.get("required", ()))
        unwritten = written = ""  # the members after the current one: when none / when one was written before
        for key, sub in reversed(list(schema["properties"].items())):
            member_body = f'{_literal(json.dumps(key))} ws ":" ws {self.value(sub, f"{hint}-{key}")}'
            member = self.add(f"{hint}-{key}", member_body)
            after = self.add(f"{hint}-after-{key}", written) if written else ""
            if key in required:
                unwritten = f"{member} {after}".strip()
                written = f'ws "," ws {member} {after}'.strip()
                continue
            without = self.add(f"{hint}-without-{key}", unwritten) if unwritten else ""
            unwritten = f"( {member} {after} | {without} )" if without else f"( {member} {after} )?"
            written = f'( ws "," ws {member} )? {after}'.strip()
        return self.add(hint, f'"{{" ws {unwritten} ws "}}"' if unwritten else '"{" ws "}"')
