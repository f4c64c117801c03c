"""A tool's JSON schema from its Python signature: type hints give the types, defaults the
defaults, a Google-style "Args:" docstring section the descriptions. An unsupported annotation is a
one-line :class:`UserError`.

Stdlib only: this module runs on phones and boards.
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Literal, Optional, Union

from slm_align.errors import UserError

_SIMPLE_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number"}
_SUPPORTED = "str, int, float, bool, list[...], dict[str, ...], Optional[...], Literal[...] or an Enum"


def function_schema(fn: Callable, name: str) -> tuple[str, dict]:
    """The docstring's first line and the JSON schema of ``fn``'s
    parameters, from its type hints."""
    summary, arg_docs = docstring_parts(fn)
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
    schema = {"type": "object", "properties": properties, "required": required,
              "additionalProperties": False}
    return summary, schema


def annotation_schema(annotation: Any, where: str = "annotation") -> dict:
    """The JSON schema of one type annotation; an unsupported one is a
    UserError naming ``where``."""
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
        raise UserError(f"{where}: *args, **kwargs and positional-only parameters "
                        "cannot be tool arguments")


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
        raise UserError(f"{where}: dictionary keys must be str (JSON object keys), got "
                        f"{_type_name(args[0])}")
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


def docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
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


def accepting_enum_values(fn: Callable) -> Callable:
    """Wrap ``fn`` so parameters annotated with an Enum receive the member,
    not the raw JSON value."""
    hints = typing.get_type_hints(fn)
    enums = {k: v for k, v in hints.items()
             if isinstance(v, type) and issubclass(v, enum.Enum) and k != "return"}
    if not enums:
        return fn

    @functools.wraps(fn)
    def call(**arguments):
        for key, enum_type in enums.items():
            if key in arguments:
                arguments[key] = enum_type(arguments[key])
        return fn(**arguments)

    return call


def type_word(schema: dict) -> str:
    """A schema's type in a word or two, as an argument example or a signature shows it."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type", "any")
    return "/".join(kind) if isinstance(kind, list) else kind

