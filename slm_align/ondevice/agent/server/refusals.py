"""Validation errors as the server's 400s, in words read off the body's types.

A body is validated with :func:`validate`, which passes the server's
:class:`~slm_align.ondevice.agent.server.body.Limits` as validation context and refuses the first error in
one line naming the field and what it accepts: ``'temperature' must be a number from 0 to 2, got
3``. What a field accepts is read off its type and constraints (:mod:`slm_align.ondevice.agent.bounds`, the
same words as `chat`'s refusals); a rule no type states (a field needed because of another) is
worded by the validator that enforces it.
"""

from __future__ import annotations

import typing
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from slm_align.ondevice.agent.bounds import Typed, is_model, of_field, optional_peeled, refusal, typed
from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.errors import ApiError, bad

Parsed = TypeVar("Parsed", bound=BaseModel)


def validate(model: type[Parsed], body: dict, limits: Limits) -> Parsed:
    """``body`` as ``model``, or the 400 :func:`to_api_error` makes of its first error."""
    try:
        return model.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        raise to_api_error(exc, model, limits) from None


def to_api_error(exc: ValidationError, model: type[BaseModel], limits: Limits) -> ApiError:
    """The 400 for a body of ``model`` that failed validation: its first
    error, at the field it reached.

    An error deeper inside a field than its fields and list items lead (a member of a union,
    ``tool_choice``'s named function) describes the whole field; an error of one union member quotes
    the value as the field's own.
    """
    error = exc.errors(include_url=False)[0]
    loc = error["loc"]
    path, kind = located(model, loc)
    deeper = len(loc) - len(path) > 1 or (len(loc) > len(path) and error["type"] == "missing")
    return bad(refusal(where(path), kind, error, limits, deeper=deeper))


def located(model: type[BaseModel], loc: tuple) -> tuple[tuple, Typed]:
    """How far an error's location leads through ``model``'s fields and list items,
    and the type it reaches."""
    kind, path = Typed(model), []
    for part in loc:
        step = _step(optional_peeled(kind).annotation, part)
        if step is None:
            break
        kind = step
        path.append(part)
    return tuple(path), kind


def _step(annotation: Any, part: Any) -> Optional[Typed]:
    """The type one location part leads to: a list's item, or a model's field (by name or alias)."""
    if isinstance(part, int) and typing.get_origin(annotation) is list:
        return typed(typing.get_args(annotation)[0])
    if isinstance(part, str) and is_model(annotation):
        for name, info in annotation.model_fields.items():
            if part in (name, info.alias):
                return of_field(info)
    return None


def where(path: tuple) -> str:
    """``'field'`` for a top-level field, ``messages[2].content`` below one."""
    if not path:
        return "the body"
    if len(path) == 1:
        return f"'{path[0]}'"
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
