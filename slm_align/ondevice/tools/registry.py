"""The tools an agent may call: declare (schemas from signatures), describe (OpenAI tool dicts),
parse a reply's calls, execute them, and constrain replies with a grammar.

Bad input while *registering* a tool raises a one-line :class:`~slm_align.errors.UserError`.
Anything that goes wrong while *running* (malformed JSON, an unknown tool, arguments that break the
schema, a tool that raises) becomes an :class:`Observation` with ``ok=False`` and a short message
the model can read and act on; nothing here raises at run time.

Stdlib and jsonschema only: this module runs on phones and boards.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any, Callable, Optional, Union

import jsonschema

from slm_align.errors import UserError
from slm_align.ondevice.tools.calls import Observation, ParsedCalls, Tool, ToolCall
from slm_align.ondevice.tools.grammar import gbnf_grammar
from slm_align.ondevice.tools.parse import FORMAT_HINT, decode_json, read_calls
from slm_align.ondevice.tools.schema import (
    accepting_enum_values,
    docstring_parts,
    function_schema,
    type_word,
)

DEFAULT_MAX_OBSERVATION_CHARS = 2000

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


class ToolRegistry:
    """The tools an agent may call, with everything needed to offer, parse, run and constrain them.

    Args:
        max_observation_chars: Longest observation content handed back to the model; longer
            results are cut and marked as truncated.
        timeout_s: Longest a tool may run before its call becomes an error observation (None: no
            limit). The call runs in a daemon thread that is abandoned, not killed, when it is late:
            Python cannot stop a thread; a tool that must not outlive its call should check time
            itself.
    """

    def __init__(self, max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
                 timeout_s: Optional[float] = None):
        if max_observation_chars < 40:
            raise UserError(f"max_observation_chars must be at least 40, got "
                            f"{max_observation_chars}")
        if timeout_s is not None and timeout_s <= 0:
            raise UserError(f"timeout_s must be above 0, got {timeout_s}")
        self.max_observation_chars = max_observation_chars
        self.timeout_s = timeout_s
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
        """Add ``fn`` as a tool; returns ``fn``. Usable as ``@registry.register`` or
        ``@registry.register(name=...)``.

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
            return functools.partial(self.register, name=name, description=description,
                                     schema=schema)
        tool_name = name or getattr(fn, "__name__", "")
        self._check_name(tool_name)
        if schema is None:
            summary, parameters = function_schema(fn, tool_name)
            function = accepting_enum_values(fn)
        else:
            summary = docstring_parts(fn)[0]
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

        Recognises ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (one or
        several; a last block whose closing tag was cut off still counts), a block holding a
        list of calls (SmolLM2) or several call objects, and a bare ``{"name": ...,
        "arguments": ...}`` object or list of them as the whole reply. ``text`` is the reply
        without the blocks. Bad JSON, an unknown tool or arguments that are not an object land
        in ``errors`` as failed observations.
        """
        outside, decoded = read_calls(text)
        parsed = ParsedCalls(text=outside)
        for item in decoded:
            self._collect(parsed, item)
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
            return Observation.failure("", "a tool call must be a JSON object with a \"name\" and "
                                           f"\"arguments\"; {FORMAT_HINT}")
        name = obj["name"]
        if name not in self._tools:
            return Observation.failure(name, self._unknown_tool(name))
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # OpenAI clients send arguments as a JSON string
            arguments = decode_json(arguments)
        if isinstance(arguments, Observation):
            return Observation.failure(name, arguments.error)
        if not isinstance(arguments, dict):
            return Observation.failure(name, f"\"arguments\" of {name} must be a JSON object "
                                             f"such as {self._example(name)}")
        return ToolCall(name=name, arguments=arguments)

    # execution

    def execute(self, call: ToolCall) -> Observation:
        """Validate ``call``'s arguments against the schema and run the tool; never raises.

        A result is turned into text (``json.dumps`` for dicts, lists and tuples, ``str``
        otherwise) and cut to ``max_observation_chars``. An unknown tool, invalid arguments or an
        exception raised by the tool give ``ok=False`` with a short message. (KeyboardInterrupt and
        SystemExit still propagate.)
        """
        tool = self._tools.get(call.name)
        if tool is None:
            return self._failure(call.name, self._unknown_tool(call.name))
        try:
            problem = self._argument_problem(tool, call.arguments)
            if problem:
                return self._failure(tool.name, problem)
            text = _to_text(self._run(tool, call.arguments))
        except TimeoutError:
            return self._failure(tool.name, f"{tool.name} did not finish "
                                            f"within {self.timeout_s:g} s")
        except Exception as exc:
            return self._failure(tool.name, f"{tool.name} failed: {_exception_text(exc)}")
        return Observation(name=tool.name, ok=True, content=self._capped(text))

    def _run(self, tool: Tool, arguments: dict) -> Any:
        """The tool's result, within ``timeout_s`` when set (TimeoutError past it)."""
        if self.timeout_s is None:
            return tool.function(**arguments)
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["result"] = tool.function(**arguments)
            except BaseException as exc:  # handed to the caller's thread, which decides
                outcome["error"] = exc

        worker = threading.Thread(target=call, name=f"tool-{tool.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            raise TimeoutError(tool.name)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

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
        return json.dumps({key: f"<{type_word(schema)}>" for key, schema in properties.items()})

    # grammar

    def gbnf_grammar(self, required: bool = False, names: Optional[list[str]] = None) -> str:
        """A llama.cpp GBNF grammar: the reply is free text or ``<tool_call>``
        blocks following the schemas.

        Free text may not start a tag (``<`` followed by a letter or ``/``), so a reply that calls a
        tool must use the grammar's path, where the name is one of the registered tools and the
        arguments are a JSON object with the schema's properties in order (optional ones may be left
        out). Schema keywords the grammar cannot express (minimum, pattern, ...) are left to
        :meth:`execute`'s validation. ``required``: calls only, no free text (OpenAI's
        ``tool_choice`` "required"), written compactly (at most one space between tokens: a small
        model pushed into a call otherwise wanders off in whitespace); ``names``: only these tools
        may be called (a named ``tool_choice``).
        """
        tools = [tool for name, tool in self._tools.items() if names is None or name in names]
        return gbnf_grammar(tools, free_text=not required, compact=required)


def _validator(tool: Tool):
    if not isinstance(tool.parameters, dict) or tool.parameters.get("type") != "object":
        raise UserError(f"tool {tool.name!r}: the schema must be a JSON object schema with "
                        f"\"type\": \"object\"")
    validator_class = jsonschema.validators.validator_for(tool.parameters)
    try:
        validator_class.check_schema(tool.parameters)
    except jsonschema.exceptions.SchemaError as exc:
        raise UserError(f"tool {tool.name!r}: invalid JSON schema: {exc.message}") from None
    return validator_class(tool.parameters)


def _signature(tool: Tool) -> str:
    required = set(tool.parameters.get("required", ()))
    parts = [
        f"{key}: {type_word(schema)}{'' if key in required else ' (optional)'}"
        for key, schema in tool.parameters.get("properties", {}).items()
    ]
    return f"{tool.name}({', '.join(parts)})"


def _exception_text(exc: Exception) -> str:
    """A ValueError is a tool's way to say "your input is wrong": its message alone;
    others keep their type."""
    return str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"


def _to_text(result: Any) -> str:
    if isinstance(result, (dict, list, tuple)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)


