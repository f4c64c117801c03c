"""BFCL's AST rules for function calls, as pure functions: does a reply's list of calls match a
task's ground truth?

The rules are those of the Berkeley Function Calling Leaderboard's checker (bfcl-eval 2026.3.23,
``bfcl_eval/eval_checker/ast_eval/ast_checker.py``, Python language), re-implemented here because
bfcl-eval pins numpy and API clients that clash with ours and drags them in on import; the
benchmark ``benchmarks/bfcl.py --official`` runs BFCL's own checker beside this one and counts the
entries where the two verdicts differ. Per call:

- the function's name, BFCL's dots written as underscores (OpenAI-style names);
- every required argument present; no argument the function or the ground truth does not name;
- each value of the type the function declares (BFCL's types: ``integer`` takes an int only, a
  bool is no int; ``float`` also takes an int; ``boolean``; ``array``/``tuple`` element-wise one
  level deep; ``dict``; ``string``/``any``); a value of the ground truth's own type instead is a
  "variable" and must then equal an allowed value exactly;
- each value among the allowed ones: strings after :func:`standardize_string` (lower case, no
  spaces and none of ``,./-_*^``, ``'`` read as ``"``), lists element-wise (strings standardised),
  dicts key by key, lists of dicts dict by dict in order, other values by ``==``;
- an argument the ground truth lists but the reply omits is wrong unless ``""`` is among its
  allowed values (BFCL's mark of an optional argument that may be left out).

The calls of a reply: the count must equal the ground truth's; with one expected call the call is
checked against it (BFCL's simple and multiple categories); with a ``parallel`` category each
expected call takes the first unmatched call that passes (BFCL's greedy order-free match). In an
``irrelevance`` category the right answer is no call at all.

The functions are described BFCL's way (``{"name", "parameters": {"properties": {arg: {"type",
"items"}}, "required"}}`` with BFCL's type words); :func:`functions_from_tools` maps OpenAI JSON
schemas to them (integer->integer, number->float, boolean->boolean, array->array, object->dict,
string->string). Stdlib only, like the rest of the rewards.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

PYTHON_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
                "tuple": list, "dict": dict, "any": str}
"""BFCL's Python type of each of its parameter type words (``PYTHON_TYPE_MAPPING``)."""
NESTED_TYPES = ("array", "tuple")
"""Type words whose elements are type-checked too (one level deep, as BFCL)."""
JSON_TO_BFCL = {"integer": "integer", "number": "float", "boolean": "boolean", "array": "array",
                "object": "dict", "string": "string"}
"""A JSON-schema type (task rows' tools) as BFCL's type word; anything else is ``any``."""
_STRIPPED = re.compile(r"[ ,./\-_*^]")
_NOTHING = object()
"""Equal to no value a model writes."""

FAILURES = ("no_call", "malformed_call", "wrong_tool", "wrong_answer")
"""How a call list fails, in the words of ``evaluate-agent``'s failure categories."""


@dataclass(frozen=True)
class Verdict:
    """The checker's answer: ``ok``, and when not, why (``reason``) and the failure's kind
    (``failure``, one of :data:`FAILURES`)."""

    ok: bool
    reason: str = ""
    failure: str = ""


PASS = Verdict(True)


def _fail(failure: str, reason: str) -> Verdict:
    return Verdict(False, reason, failure)


def standardize_string(text: str) -> str:
    """BFCL's string normal form: spaces and ``,./-_*^`` removed, lower case, ``'`` as ``"``
    ("April 1, 2024" and "april 1,2024" compare equal)."""
    return _STRIPPED.sub("", text).lower().replace("'", '"')


def _standard(value: Any) -> Any:
    """A string standardised; any other value as it is."""
    return standardize_string(value) if isinstance(value, str) else value


def _answer_type(allowed: Sequence[Any]) -> Optional[type]:
    """The type of the first allowed value that is not ``""`` (None when all are)."""
    for value in allowed:
        if value != "":
            return type(value)
    return None


def _items_match(value: list, allowed: Sequence[Any], items_type: type) -> bool:
    """BFCL's one-level element check: for some allowed value, each element of ``value`` is of
    ``items_type`` or of that allowed list's own element type (an allowed value that is no list,
    ``""`` included, passes at once, as in BFCL)."""
    for option in allowed:
        if not isinstance(option, list):
            return True
        if all(_type_ok(item, option, items_type, None)[0] for item in value):
            return True
    return False


def _type_ok(value: Any, allowed: Sequence[Any], expected: type, items_type: Optional[type]
             ) -> tuple[bool, bool]:
    """(the value passes BFCL's type check, it is a "variable": the ground truth's values are of
    another type than the declared one). Types compare exactly (a bool is no int)."""
    answer_type = _answer_type(allowed)
    variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if items_type is None or _items_match(value, allowed, items_type):
            return True, variable
        return False, variable
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, variable


def _string_ok(value: str, allowed: Sequence[Any]) -> bool:
    """The standardised string is one of the standardised allowed strings."""
    return standardize_string(value) in [standardize_string(a) for a in allowed
                                         if isinstance(a, str)]


def _as_items(option: Any) -> list:
    """An allowed list value element by element (BFCL iterates whatever it is given: ``""``
    yields no element, so it allows the empty list); a value it cannot iterate allows nothing."""
    try:
        return list(option)
    except TypeError:
        return [_NOTHING]


def _list_ok(value: list, allowed: Sequence[Any]) -> bool:
    """The list, its strings standardised, equals an allowed list standardised the same way."""
    options = [[_standard(item) for item in _as_items(option)] for option in allowed]
    return [_standard(item) for item in value] in options


def _dict_matches(value: dict, option: Any) -> bool:
    """Every key of ``value`` is one of the allowed dict's, with a value among its allowed ones
    (strings standardised); every allowed key is present unless ``""`` is allowed for it."""
    if not isinstance(option, dict):
        return False
    for key, item in value.items():
        if key not in option or _standard(item) not in [_standard(a) for a in option[key]]:
            return False
    return all(key in value or "" in options for key, options in option.items())


def _dict_ok(value: dict, allowed: Sequence[Any]) -> bool:
    """The dict matches one of the allowed dicts (``""`` entries skipped)."""
    return any(_dict_matches(value, option) for option in allowed if option != "")


def _list_of_dicts_ok(value: list, allowed: Sequence[Any]) -> bool:
    """For some allowed list of dicts of the same length, each dict matches its counterpart, in
    order."""
    for option in allowed:
        items = _as_items(option)
        if len(items) != len(value):
            continue
        if all(isinstance(v, dict) and _dict_matches(v, o) for v, o in zip(value, items)):
            return True
    return False


def _value_ok(value: Any, allowed: Sequence[Any], expected: type,
              items_type: Optional[type]) -> bool:
    """BFCL's value rule for a value that passed the type check as the declared type."""
    if expected is dict:
        return _dict_ok(value, allowed)
    if expected is list and items_type is dict:
        return _list_of_dicts_ok(value, allowed)
    if expected is str:
        return _string_ok(value, allowed)
    if expected is list:
        return _list_ok(value, allowed)
    return value in allowed


def _declared(detail: dict) -> tuple[str, type, Optional[type]]:
    """A parameter's BFCL type word, its Python type and its elements' (None unless nested)."""
    word = detail.get("type", "any")
    expected = PYTHON_TYPES.get(word, str)
    items_type = None
    if word in NESTED_TYPES:
        items_type = PYTHON_TYPES.get(detail.get("items", {}).get("type", "any"), str)
    return word, expected, items_type


def check_argument(name: str, value: Any, allowed: Sequence[Any], detail: dict) -> Verdict:
    """One argument's value against its allowed values and its declared type (``detail``: the
    parameter's BFCL description, ``{"type", "items"}``)."""
    word, expected, items_type = _declared(detail)
    if word == "float" and type(value) is int:
        value = float(value)  # BFCL: Python turns an int into a float
    type_ok, variable = _type_ok(value, allowed, expected, items_type)
    if not type_ok:
        return _fail("wrong_answer", f"argument {name!r}: {value!r} is not of type {word}")
    right = value in allowed if variable else _value_ok(value, allowed, expected, items_type)
    if not right:
        return _fail("wrong_answer", f"argument {name!r}: {value!r} is not one of "
                                     f"{list(allowed)!r}")
    return PASS


def call_name(function: dict) -> str:
    """The name a model calls a BFCL function by: its dots as underscores (OpenAI's names allow
    none, and BFCL's OpenAI handler offers them so)."""
    return function["name"].replace(".", "_")


def check_call(call: dict, function: dict, expected: dict) -> Verdict:
    """One call (``{"name", "arguments"}``) against one function and one expected call
    (``{function_name: {argument: [allowed values]}}``): BFCL's ``simple_function_checker``."""
    allowed_by_argument = next(iter(expected.values()))
    if call.get("name") != call_name(function):
        return _fail("wrong_tool", f"called {call.get('name')!r}, expected {call_name(function)!r}")
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        return _fail("malformed_call", f"the call to {call.get('name')!r} has no argument object")
    parameters = function.get("parameters", {})
    properties = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in arguments:
            return _fail("wrong_answer", f"required argument {name!r} missing")
    for name, value in arguments.items():
        if name not in properties or name not in allowed_by_argument:
            return _fail("wrong_answer", f"unexpected argument {name!r}")
        verdict = check_argument(name, value, allowed_by_argument[name], properties[name])
        if not verdict.ok:
            return verdict
    for name, allowed in allowed_by_argument.items():
        if name not in arguments and "" not in allowed:
            return _fail("wrong_answer", f"argument {name!r} missing (the answer needs it)")
    return PASS


def _function(functions: Sequence[dict], expected: dict) -> dict:
    """The function an expected call names; a ground truth naming none is a KeyError (a task row
    that cannot be scored: see :func:`unknown_functions`)."""
    name = next(iter(expected))
    for function in functions:
        if function["name"] == name:
            return function
    raise KeyError(name)


def _order_free(calls: Sequence[dict], functions: Sequence[dict],
                ground_truth: Sequence[dict]) -> Verdict:
    """BFCL's ``parallel_function_checker_no_order``: each expected call, in order, takes the first
    call not yet taken that passes; the first expected call none passes fails the list."""
    taken: set[int] = set()
    for index, expected in enumerate(ground_truth):
        function = _function(functions, expected)
        verdict = _fail("wrong_answer", "no call left")
        for position, call in enumerate(calls):
            if position in taken:
                continue
            verdict = check_call(call, function, expected)
            if verdict.ok:
                taken.add(position)
                break
        if not verdict.ok:
            return _fail(verdict.failure, f"expected call {index} matches no call "
                                          f"({verdict.reason})")
    return PASS


def is_irrelevance(category: Optional[str]) -> bool:
    """The category's right answer is no call (BFCL's irrelevance, live_irrelevance)."""
    return bool(category) and "irrelevance" in category


def default_category(ground_truth: Sequence[dict]) -> str:
    """The category a row without one is checked as: irrelevance without expected calls,
    parallel (order-free) with several, simple with one."""
    if not ground_truth:
        return "irrelevance"
    return "parallel" if len(ground_truth) > 1 else "simple"


def check_calls(calls: Sequence[Optional[dict]], ground_truth: Sequence[dict],
                functions: Sequence[dict], category: Optional[str] = None) -> Verdict:
    """A reply's calls against a task's ground truth by BFCL's AST rules.

    Args:
        calls: The reply's calls, ``{"name", "arguments"}`` each, as the runtime's parser reads
            them; a call that did not parse has ``arguments`` None.
        ground_truth: BFCL's possible answer: one ``{function_name: {argument: [allowed]}}`` per
            expected call ([] for irrelevance).
        functions: The functions offered, described BFCL's way (:func:`functions_from_tools`).
        category: BFCL's test category (``simple_python``, ``multiple``, ``parallel``,
            ``parallel_multiple``, ``irrelevance``, ...); None: :func:`default_category`.
    """
    category = category or default_category(ground_truth)
    if is_irrelevance(category):
        if calls:
            return _fail("wrong_tool", f"{len(calls)} call(s) where no function fits")
        return PASS
    if not calls:
        return _fail("no_call", "no call")
    if any(call is None or not isinstance(call.get("arguments"), dict) for call in calls):
        return _fail("malformed_call", "a call did not parse")
    if len(calls) != len(ground_truth):
        return _fail("wrong_answer", f"{len(calls)} call(s), expected {len(ground_truth)}")
    if "parallel" in category:
        return _order_free(calls, functions, ground_truth)
    return check_call(calls[0], _function(functions, ground_truth[0]), ground_truth[0])


def unknown_functions(ground_truth: Sequence[dict], functions: Sequence[dict]) -> list[str]:
    """The functions the ground truth names that are not among ``functions``."""
    offered = {function["name"] for function in functions}
    return [name for expected in ground_truth for name in expected if name not in offered]


def _bfcl_parameter(schema: dict) -> dict:
    """One JSON-schema parameter described with BFCL's type words (elements too)."""
    kind = schema.get("type")
    detail = {"type": JSON_TO_BFCL.get(kind, "any") if isinstance(kind, str) else "any"}
    if isinstance(schema.get("items"), dict):
        detail["items"] = _bfcl_parameter(schema["items"])
    return detail


def functions_from_tools(tools: Sequence[dict]) -> list[dict]:
    """OpenAI tools (``{"type": "function", "function": {...}}`` or bare) described BFCL's way:
    names as they are, JSON-schema types as BFCL's (:data:`JSON_TO_BFCL`), ``required`` kept."""
    functions = []
    for tool in tools:
        inner = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        parameters = inner.get("parameters") or {}
        properties = {name: _bfcl_parameter(schema) for name, schema in
                      (parameters.get("properties") or {}).items()}
        functions.append({"name": inner["name"], "parameters": {
            "properties": properties, "required": list(parameters.get("required") or [])}})
    return functions


GRADED_CAP = 0.9
"""The scale of :func:`graded_score` for a reply :func:`check_calls` fails (its most): full marks
stay the strict verdict's."""
_MOST_PERMUTED = 6


def _needed(name: str, expected: dict, required: Sequence[str]) -> bool:
    """The argument must be given: the function requires it, or the answer lists it without
    ``""``."""
    return name in required or (name in expected and "" not in expected[name])


def pair_score(call: Optional[dict], function: dict, expected: dict) -> float:
    """Partial credit of one call against one expected call, (name + names + values) / 3: the
    name right (else 0); the share of the arguments concerned (expected, given or required) whose
    presence is right (needed ones given, none unknown); the share of them whose value is right by
    BFCL's rules (an optional one left out counts as right)."""
    if call is None or call.get("name") != call_name(function):
        return 0.0
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        return 1 / 3
    allowed = next(iter(expected.values()))
    parameters = function.get("parameters", {})
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    concerned = set(allowed) | set(arguments) | set(required)
    if not concerned:
        return 1.0
    names = values = 0
    for name in concerned:
        known = name in properties and name in allowed
        given = name in arguments
        if given and not known:
            continue
        if given or not _needed(name, allowed, required):
            names += 1
            values += (not given) or check_argument(name, arguments[name], allowed[name],
                                                    properties[name]).ok
    return (1 + names / len(concerned) + values / len(concerned)) / 3


def _best_total(scores: list[list[float]]) -> float:
    """The largest sum of scores pairing each call with at most one expected call: every
    assignment for up to six, else greedily by score (rows: calls, columns: expected calls)."""
    rows, columns = len(scores), len(scores[0])
    if max(rows, columns) <= _MOST_PERMUTED:
        if rows <= columns:
            return max(sum(scores[r][c] for r, c in enumerate(p))
                       for p in itertools.permutations(range(columns), rows))
        return max(sum(scores[r][c] for c, r in enumerate(p))
                   for p in itertools.permutations(range(rows), columns))
    cells = sorted(((scores[r][c], r, c) for r in range(rows) for c in range(columns)),
                   reverse=True)
    used_rows, used_columns, total = set(), set(), 0.0
    for score, r, c in cells:
        if r not in used_rows and c not in used_columns:
            used_rows.add(r)
            used_columns.add(c)
            total += score
    return total


def graded_score(calls: Sequence[Optional[dict]], ground_truth: Sequence[dict],
                 functions: Sequence[dict], category: Optional[str] = None) -> float:
    """Shaping credit from 0 to 1: 1 when :func:`check_calls` passes; irrelevance 0 otherwise;
    else the best pairing of calls with expected calls (order-free) of :func:`pair_score`,
    summed and divided by the larger of the two counts (a missing or extra call costs its share),
    times :data:`GRADED_CAP`."""
    if check_calls(calls, ground_truth, functions, category).ok:
        return 1.0
    if is_irrelevance(category or default_category(ground_truth)) or not calls:
        return 0.0
    expected = [(_function(functions, entry), entry) for entry in ground_truth]
    scores = [[pair_score(call, function, entry) for function, entry in expected] for call in calls]
    return GRADED_CAP * _best_total(scores) / max(len(calls), len(ground_truth))
