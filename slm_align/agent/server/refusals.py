"""Validation errors as the server's 400s: a body is validated with :func:`validate`, which passes the server's
:class:`~slm_align.agent.server.body.Limits` as validation context and maps the first error to the one-line message
clients have always received (:func:`to_api_error`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from string import Template
from typing import Optional, TypeVar

from pydantic import BaseModel, ValidationError

from slm_align.agent.logprobs import MAX_TOP_LOGPROBS
from slm_align.agent.server.body import MAX_ARGUMENT_DEPTH, Limits
from slm_align.agent.server.errors import ApiError, bad
from slm_align.agent.store import FEEDBACK_KINDS

ROLES = ("system", "user", "assistant", "tool")

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
