"""Synthetic replies to BFCL entries for ``bfcl.py --official``: each entry's ground truth rendered as
calls (the first allowed value of every argument), and that answer broken one way at a time.

A variant is a function ``(row) -> calls or None`` (None: it does not apply to the entry); calls are
``{"name", "arguments"}`` as the runtime's parser reads them, with the names the model is offered
(BFCL's dots as underscores).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from slm_align.ondevice.rewards.function_match import call_name


def first_value(allowed: list) -> Any:
    """The first allowed value that is not ``""``, its dicts rendered too (``_MISSING`` if none)."""
    for value in allowed:
        if value != "":
            return render(value)
    return _MISSING


_MISSING = object()


def render(value: Any) -> Any:
    """An allowed value as a model writes it: a dict of allowed lists becomes a dict of first values."""
    if isinstance(value, dict):
        rendered = {key: first_value(options) for key, options in value.items()}
        return {key: item for key, item in rendered.items() if item is not _MISSING}
    if isinstance(value, list):
        return [render(item) for item in value]
    return value


def truth_calls(row: dict) -> list[dict]:
    """The ground truth as calls, in its order."""
    functions = {function["name"]: function for function in row["functions"]}
    calls = []
    for expected in row["ground_truth"]:
        name, allowed = next(iter(expected.items()))
        arguments = {argument: first_value(options) for argument, options in allowed.items()}
        calls.append({"name": call_name(functions[name]),
                      "arguments": {key: value for key, value in arguments.items() if value is not _MISSING}})
    return calls


def _first_argument(calls: list[dict], kinds: tuple = (object,)) -> Optional[tuple[dict, str]]:
    """The first call's first argument whose value is one of ``kinds`` (bools only when asked)."""
    for call in calls:
        for name, value in call["arguments"].items():
            if isinstance(value, bool) and bool not in kinds:
                continue
            if isinstance(value, kinds):
                return call, name
    return None


def _changed(row: dict, kinds: tuple, change: Callable) -> Optional[list[dict]]:
    calls = copy.deepcopy(truth_calls(row))
    found = _first_argument(calls, kinds)
    if found is None:
        return None
    call, name = found
    call["arguments"][name] = change(call["arguments"][name])
    return calls


def _other_type(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return 1
    return "x"


def _other_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + " zzz"
    if isinstance(value, list):
        return value[::-1] + value[:1] if value else ["zzz"]
    return {**value, "zzz": 1} if isinstance(value, dict) else value


def _int_for_float(row: dict) -> Optional[list[dict]]:
    calls = copy.deepcopy(truth_calls(row))
    for call in calls:
        for name, value in call["arguments"].items():
            if isinstance(value, float) and value.is_integer():
                call["arguments"][name] = int(value)
                return calls
    return None


def _restyled(value: str) -> str:
    return value.upper().replace(" ", "  ") + "."


def _missing(row: dict) -> Optional[list[dict]]:
    calls = copy.deepcopy(truth_calls(row))
    for call in calls:
        if call["arguments"]:
            call["arguments"].pop(next(iter(call["arguments"])))
            return calls
    return None


def _extra(row: dict) -> Optional[list[dict]]:
    calls = copy.deepcopy(truth_calls(row))
    if not calls:
        return None
    calls[-1]["arguments"]["unexpected_argument"] = 1
    return calls


def _renamed(row: dict) -> Optional[list[dict]]:
    calls = copy.deepcopy(truth_calls(row))
    if not calls:
        return None
    calls[0]["name"] = calls[0]["name"] + "_v2"
    return calls


def _reversed(row: dict) -> Optional[list[dict]]:
    calls = truth_calls(row)
    return calls[::-1] if len(calls) > 1 else None


def _one_less(row: dict) -> Optional[list[dict]]:
    calls = truth_calls(row)
    return calls[:-1] if len(calls) > 1 else None


def _first_function_called(row: dict) -> list[dict]:
    """A call of the first offered function with its required arguments as strings (for irrelevance)."""
    function = row["functions"][0]
    required = function["parameters"].get("required", [])
    return [{"name": call_name(function), "arguments": {name: "1" for name in required}}]


ANY = (bool, int, float, str, list, dict)


def _wrong_type(row: dict) -> Optional[list[dict]]:
    return _changed(row, ANY, _other_type)


def _wrong_value(row: dict) -> Optional[list[dict]]:
    return _changed(row, ANY, _other_value)


def _restyled_string(row: dict) -> Optional[list[dict]]:
    return _changed(row, (str,), _restyled)


def _no_call(row: dict) -> list[dict]:
    return []


VARIANTS: dict[str, Callable[[dict], Optional[list[dict]]]] = {
    "truth": truth_calls,
    "reversed_order": _reversed,
    "one_call_less": _one_less,
    "wrong_type": _wrong_type,
    "wrong_value": _wrong_value,
    "restyled_string": _restyled_string,
    "int_for_float": _int_for_float,
    "missing_argument": _missing,
    "extra_argument": _extra,
    "wrong_name": _renamed,
    "no_call": _no_call,
}
"""Replies to an entry with an expected call; irrelevance: :data:`IRRELEVANCE_VARIANTS`."""
IRRELEVANCE_VARIANTS = {"no_call": _no_call, "a_call": _first_function_called}


def variants(row: dict) -> dict[str, list[dict]]:
    """Every variant that applies to the entry, by name."""
    table = IRRELEVANCE_VARIANTS if not row["ground_truth"] else VARIANTS
    made = {name: make(row) for name, make in table.items()}
    return {name: calls for name, calls in made.items() if calls is not None}
