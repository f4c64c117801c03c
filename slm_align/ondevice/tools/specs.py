"""Tool lists as task rows and clients write them (OpenAI's format): decoded, cleaned and checked.

``{"type": "function", "function": {"name", "description", "parameters"}}`` or the bare inner
object; ``parameters`` must be a valid JSON schema.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema

from slm_align.errors import UserError
from slm_align.ondevice.tools.registry import ToolRegistry


def normalise_tools(where: str, tools: Any) -> Optional[list[dict]]:
    """A row's ``tools`` as a list of tool dicts: decoded when stored as JSON text, None-valued keys
    (which parquet adds when it merges different schemas into one struct) removed; each tool must
    have a name and, when it has parameters, a valid JSON schema for them."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: 'tools' is text but not JSON ({exc.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise UserError(f"{where}: 'tools' must be a list of tool objects "
                        '({"type": "function", "function": {"name", "description", "parameters"}})')
    cleaned = [_without_nones(tool) for tool in tools]
    for tool in cleaned:
        _check_tool(where, tool)
    return cleaned


def _without_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nones(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nones(item) for item in value]
    return value


def tool_function(tool: dict) -> dict:
    """The ``{"name", "description", "parameters"}`` part of an OpenAI tool (or the
    tool itself when bare)."""
    inner = tool.get("function")
    return inner if isinstance(inner, dict) else tool


def _check_tool(where: str, tool: dict) -> None:
    function = tool_function(tool)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: a tool in 'tools' has no name; use "
                        '{"type": "function", "function": {"name", "description", "parameters"}}')
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict):
        raise UserError(f"{where}: tool {name!r}: 'parameters' must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.exceptions.SchemaError as exc:
        raise UserError(f"{where}: tool {name!r}: invalid JSON schema for its "
                        f"parameters ({exc.message})") from None


class _Unavailable:
    """Stands in for a tool of a task's schemas that nothing here can run."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, **_):
        raise ValueError(f"{self.name} cannot be run here: no tool of that "
                         "name was given to run it")


def registry_for_row(row_tools, executables: ToolRegistry) -> ToolRegistry:
    """A registry with a task row's tool schemas (as the model is shown them), each running the
    same-named tool of ``executables``; one it lacks answers with an error observation."""
    registry = ToolRegistry()
    for tool in normalise_tools("tools", row_tools) or []:
        function = tool_function(tool)
        name = function["name"]
        parameters = {"type": "object", **function.get("parameters", {})}
        runnable = executables.get(name)
        registry.register(runnable.function if runnable else _Unavailable(name), name=name,
                          description=function.get("description") or name, schema=parameters)
    return registry
