"""What a typed field accepts, in words: the one source of the phrases in the server's
400s and `chat`'s refusals.

A phrase is read off the field's type and constraints (pydantic's ``Field(ge=, le=, gt=, lt=,
min_length=, max_length=)``, ``Literal`` choices, nested models), so the bound written on a type is
the bound its refusal names: ``a number from 0 to 2``, ``an integer >= 1``, ``one of "up",
"down"``, ``a non-empty list of messages``. A bound that depends on where the value arrives (a
server's limits) is metadata with a ``bounds(context)`` method returning the constraints it
enforces there (``{"le": 4096}``).

Refusals of errors that pydantic raises read ``<where> must be <phrase>, got <value>``; an
error a validator raises with its own words (a rule across fields, which no type states)
reads ``<where> <its words>``.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

BOUND_KEYS = ("ge", "gt", "le", "lt", "min_length", "max_length")
PYDANTIC_ERRORS = frozenset(typing.get_args(core_schema.ErrorType))
"""Error types pydantic raises itself; any other was raised by one of our
validators, in its own words."""
RANGE_ERRORS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")
"""A value out of range is quoted as Python prints it; a value of the wrong type as JSON."""
NOUNS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("text", "strings"),
         bool: ("true or false", "booleans"), dict: ("an object", "objects")}


@dataclass
class Typed:
    """A field's type with its ``Annotated`` layers peeled: the bare type, its
    metadata, its description."""

    annotation: Any
    metadata: list = field(default_factory=list)
    description: Optional[str] = None


def typed(annotation: Any, metadata: Sequence = (), description: Optional[str] = None) -> Typed:
    """``annotation`` without its ``Annotated`` layers; their metadata (``Field``'s
    constraints flattened) kept."""
    items = list(metadata)
    while typing.get_origin(annotation) is Annotated:
        annotation, *more = typing.get_args(annotation)
        items = more + items
    flat = []
    for item in items:
        if isinstance(item, FieldInfo):
            flat.extend(item.metadata)
            description = description or item.description
        else:
            flat.append(item)
    return Typed(annotation, flat, description)


def of_field(info: FieldInfo) -> Typed:
    """A model field's type, constraints and description."""
    return typed(info.annotation, info.metadata, info.description)


def bounds(metadata: list, context: Any = None) -> dict:
    """The constraints in ``metadata`` (ge, gt, le, lt, min_length, max_length), those
    of ``context`` included."""
    found = {}
    for item in metadata:
        if callable(getattr(item, "bounds", None)):
            if context is not None:
                found.update(item.bounds(context))
            continue
        found.update({key: getattr(item, key) for key in BOUND_KEYS if getattr(item, key, None) is not None})
    return found


def members(annotation: Any) -> list:
    """The members of a union other than None (the annotation itself when it is no union)."""
    if typing.get_origin(annotation) in (Union, UnionType):
        return [member for member in typing.get_args(annotation) if member is not NoneType]
    return [annotation]


def optional_peeled(kind: Typed) -> Typed:
    """``Optional[X]`` as ``X``, the outer metadata kept; any other type as it is."""
    inner = members(kind.annotation)
    if len(inner) != 1 or inner[0] is kind.annotation:
        return kind
    peeled = typed(inner[0])
    return Typed(peeled.annotation, kind.metadata + peeled.metadata, kind.description or peeled.description)


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _numeric(annotation: Any) -> bool:
    return typed(annotation).annotation in (int, float)


def _shown(value: Any) -> str:
    """A bound as people read it: 2**63-1 for SQLite's largest integer, 0.5 for a half."""
    if isinstance(value, int) and value >= 1 << 32:
        for bits in range(32, 129):
            if value in ((1 << bits) - 1, 1 << bits):
                return f"2**{bits}" + ("-1" if value & 1 else "")
    return f"{value:g}" if isinstance(value, float) else str(value)


def _ranged(noun: str, limits: dict) -> str:
    """``noun`` with its numeric bounds: ``from 0 to 2`` when both ends are closed,
    else ``>= 1``, ``< 0.5``."""
    if "ge" in limits and "le" in limits:
        return f"{noun} from {_shown(limits['ge'])} to {_shown(limits['le'])}"
    parts = [f"{sign} {_shown(limits[key])}" for key, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
             if key in limits]
    return " ".join([noun, " and ".join(parts)]) if parts else noun


def _text(limits: dict) -> str:
    noun = "non-empty text" if limits.get("min_length") == 1 else "text"
    if "max_length" in limits:
        return f"{noun} of at most {limits['max_length']} characters"
    return noun


def _either(phrases: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} or {phrases[-1]}"


def _choices(values: tuple) -> str:
    quoted = [json.dumps(value) for value in values]
    return quoted[0] if len(quoted) == 1 else f"one of {', '.join(quoted)}"


def _shape(model: type[BaseModel]) -> str:
    """A model as the JSON object it reads: ``{"type": "function", "function":
    {"name", "arguments"}}``."""
    parts = []
    for name, info in model.model_fields.items():
        key = json.dumps(info.alias or name)
        inner = optional_peeled(of_field(info)).annotation
        if typing.get_origin(inner) is Literal and len(typing.get_args(inner)) == 1:
            parts.append(f"{key}: {json.dumps(typing.get_args(inner)[0])}")
        elif is_model(inner):
            parts.append(f"{key}: {_shape(inner)}")
        else:
            parts.append(key)
    return "{" + ", ".join(parts) + "}"


def _plural(annotation: Any) -> str:
    """What a list of ``annotation`` holds, in the plural: ``messages`` (a model's title),
    ``non-empty strings``."""
    kind = typed(annotation)
    if is_model(kind.annotation):
        title = kind.annotation.model_config.get("title")
        return f"{title}s" if title else "objects"
    noun = NOUNS.get(kind.annotation, ("", "values"))[1]
    return f"non-empty {noun}" if bounds(kind.metadata).get("min_length") == 1 else noun


def _listed(item: Any, limits: dict) -> str:
    head = "a non-empty list" if limits.get("min_length") == 1 else "a list"
    size = f"at most {limits['max_length']} " if "max_length" in limits else ""
    return f"{head} of {size}{_plural(item)}"


def accepted(annotation: Any, metadata: Sequence = (), context: Any = None) -> str:
    """What a value of ``annotation`` under ``metadata``'s constraints must be, as a phrase;
    ``context`` fills in the bounds that depend on it."""
    kind = typed(annotation, metadata)
    limits = bounds(kind.metadata, context)
    bare = kind.annotation
    inner = members(bare)
    if inner != [bare]:
        if len(inner) == 1:
            return accepted(inner[0], kind.metadata, context)
        if all(_numeric(member) for member in inner):
            return _ranged("a number", limits)
        return _either([accepted(member, (), context) for member in inner])
    if typing.get_origin(bare) is Literal:
        return _choices(typing.get_args(bare))
    if typing.get_origin(bare) is list:
        return _listed(typing.get_args(bare)[0], limits)
    if is_model(bare):
        return _shape(bare)
    if bare is str:
        return _text(limits)
    return _ranged(NOUNS.get(bare, ("a value", ""))[0], limits)


def _got(error: dict) -> str:
    value = error.get("input")
    if error["type"] in RANGE_ERRORS:
        return str(value)
    return json.dumps(value, default=str)[:60]


def refusal(where: str, kind: Typed, error: dict, context: Any = None, deeper: bool = False) -> str:
    """The one line refusing a value of the field ``kind`` at ``where`` (``'temperature'``,
    ``--temperature``) for pydantic's ``error``; ``deeper``: the error lies inside the value (a
    union's member), so the whole is described."""
    phrase = accepted(kind.annotation, kind.metadata, context)
    name, details = error["type"], error.get("ctx") or {}
    if deeper:
        return f"{where} must be {phrase}"
    if name not in PYDANTIC_ERRORS:
        return f"{where} {error['msg']}"
    if name == "missing":
        return f"{where} is required: {kind.description or phrase}"
    if name == "too_long" and "actual_length" in details:
        held = optional_peeled(kind).annotation
        items = _plural(typing.get_args(held)[0]) if typing.get_origin(held) is list else "items"
        return f"{where} has {details['actual_length']} {items}; at most {details['max_length']} are accepted"
    if name == "string_too_long":
        return f"{where} is longer than {details['max_length']} characters"
    return f"{where} must be {phrase}, got {_got(error)}"
