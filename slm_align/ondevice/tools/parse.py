"""Tool calls read from a model's reply, in the Hermes / Qwen2.5 text format::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2*(3+4)"}}
    </tool_call>

(one or several blocks), SmolLM2's list form ``<tool_call>[{"name": ...}, {"name":
...}]</tool_call>`` (several calls in one block, as are several objects one after another), or a
bare ``{"name": ..., "arguments": {...}}`` object (or a list of them) as the whole reply. Reading
never raises: JSON that does not parse, or that passes the bounds (nested deeper than
:data:`MAX_DEPTH`, a number longer than :data:`MAX_NUMBER_CHARS`), becomes a failed
:class:`~slm_align.ondevice.tools.calls.Observation` the model can read.

Stdlib only: this module runs on phones and boards.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

from slm_align.ondevice.tools.calls import Observation

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCED = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
FORMAT_HINT = 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
MAX_DEPTH = 64
"""Deepest nesting of arrays and objects in a call (the call object itself is level 1; ``serve``
bounds a request's call arguments at 64 levels too). Python's json decoder recurses, and raises
RecursionError at about 1,000 levels; the schema check, ``json.dumps`` and the template's ``tojson``
recurse too: a model's reply must not take them deeper."""
MAX_NUMBER_CHARS = 1000
"""Longest number literal in a call. Python refuses to turn more than 4,300 digits into an int
(ValueError) and takes quadratic time below that."""


class OutOfBounds(ValueError):
    """A call's JSON passes :data:`MAX_DEPTH` or :data:`MAX_NUMBER_CHARS`."""


def _bounded_number(text: str, kind: type) -> Any:
    if len(text) > MAX_NUMBER_CHARS:
        raise OutOfBounds(f"a number of {len(text)} characters, more than {MAX_NUMBER_CHARS}")
    return kind(text)


def _int(text: str) -> int:
    return _bounded_number(text, int)


def _float(text: str) -> float:
    return _bounded_number(text, float)


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels (walked without
    recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _check_depth(value: Any) -> Any:
    if _deeper_than(value, MAX_DEPTH):
        raise _too_deep()
    return value


def _too_deep() -> OutOfBounds:
    return OutOfBounds(f"nested deeper than {MAX_DEPTH} levels")


def _raw_decode(text: str, position: int) -> tuple[Any, int]:
    """``json.JSONDecoder.raw_decode`` within the bounds: OutOfBounds past them (the decoder's
    RecursionError included), JSONDecodeError for text that is not JSON."""
    try:
        value, end = _DECODER.raw_decode(text, position)
    except RecursionError:
        raise _too_deep() from None
    return _check_depth(value), end


def _out_of_bounds(exc: ValueError) -> Observation:
    return Observation.failure("", f"tool call out of bounds ({exc}); {FORMAT_HINT}")


def _unfence(text: str) -> str:
    match = _FENCED.match(text)
    return match.group(1) if match else text


def decode_json(text: str) -> Union[Any, Observation]:
    """The JSON value in ``text``, or a failed observation saying why it is not JSON or passes the
    bounds."""
    try:
        return _check_depth(_DECODER.decode(text))
    except RecursionError:
        return _out_of_bounds(_too_deep())
    except json.JSONDecodeError as exc:
        return Observation.failure("", f"malformed JSON in tool call ({exc.msg} at character "
                                   f"{exc.pos}); {FORMAT_HINT}")
    except ValueError as exc:  # OutOfBounds, or a number Python refuses
        return _out_of_bounds(exc)


def _decode_calls(text: str) -> list:
    """The calls of one block: a call object, a list of them (SmolLM2's form), or
    several objects one after another (each still to be checked); a failed observation
    when the block is not JSON."""
    values = []
    position = 0
    while position < len(text):
        try:
            value, end = _raw_decode(text, position)
        except json.JSONDecodeError:
            return [decode_json(text)]
        except ValueError as exc:  # OutOfBounds, or a number Python refuses
            return [_out_of_bounds(exc)]
        values.extend(value if isinstance(value, list) and value else [value])
        position = len(text) - len(text[end:].lstrip())
    return values or [decode_json(text)]


def _is_call(obj: Any) -> bool:
    return isinstance(obj, dict) and ("arguments" in obj or "parameters" in obj)


def _looks_like_calls(obj: Any) -> bool:
    """A call object, or a non-empty list of them."""
    if isinstance(obj, list):
        return bool(obj) and all(_is_call(item) for item in obj)
    return _is_call(obj)


def _bare_calls(text: str) -> Optional[list]:
    """A whole reply that is a ``{"name": ..., "arguments": ...}`` object or a list of them;
    None for ordinary text."""
    candidate = _unfence(text.strip())
    bracketed = candidate[:1] + candidate[-1:] in ("{}", "[]")
    if not (bracketed and '"name"' in candidate):
        return None
    decoded = decode_json(candidate)
    if isinstance(decoded, Observation):  # looks like a call ("name" and "arguments") but is broken
        return [decoded] if '"arguments"' in candidate else None
    if not _looks_like_calls(decoded):
        return None
    return decoded if isinstance(decoded, list) else [decoded]


def read_calls(text: str) -> tuple[str, list]:
    """A reply split into the text outside its calls and the calls' decoded JSON values, in
    order (each still to be checked against the tools), a failed :class:`Observation` standing
    in for a call that is not JSON.

    With ``<tool_call>`` blocks, the text is what lies between them (a last block whose closing tag
    was cut off still counts); a reply that is a bare call object (or a list of them) has no text;
    any other reply is all text.
    """
    if "<tool_call>" in text:
        parts = _TOOL_CALL_BLOCK.split(text)  # text, call body, text, call body, ..., text
        outside = "\n".join(part.strip() for part in parts[0::2] if part.strip())
        return outside, [decoded for body in parts[1::2]
                         for decoded in _decode_calls(_unfence(body.strip()))]
    bare = _bare_calls(text)
    if bare is None:
        return text.strip(), []
    return "", bare


def call_text(calls: list) -> str:
    """``calls`` (:class:`~slm_align.ondevice.tools.calls.ToolCall`) as the text a model writes them
    in: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call, one per line, what
    :func:`read_calls` reads back (and the runtime's grammar allows)."""
    blocks = [json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
              for call in calls]
    return "\n".join(f"<tool_call>{block}</tool_call>" for block in blocks)
