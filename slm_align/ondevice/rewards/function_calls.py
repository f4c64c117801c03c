"""Rewards for function calling by BFCL's rules: ``function_call_match`` (1 when the reply's calls
match the row's ``ground_truth``, else 0; for irrelevance 1 when there is no call) and
``function_call_graded`` (partial credit for name, argument names and values, for shaping).

Calls are read by the runtime's own parser (:func:`slm_align.ondevice.tools.parse.read_calls`) from
the completion; on agent episodes from the episode's first reply (the calls are the answer: a
function task's tools need not run). The rules: :mod:`slm_align.ondevice.rewards.function_match`.
Torch-free.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence

from slm_align.errors import UserError
from slm_align.ondevice.rewards.function_match import (
    check_calls,
    functions_from_tools,
    graded_score,
    unknown_functions,
)
from slm_align.ondevice.tools.calls import Observation
from slm_align.ondevice.tools.parse import decode_json, read_calls
from slm_align.ondevice.tools.specs import normalise_tools


def _as_call(decoded: Any) -> dict:
    """A decoded call as ``{"name", "arguments"}``, ``arguments`` None when it is not an object
    (as the runtime records a call it could not read); arguments sent as JSON text are decoded,
    as the runtime's registry decodes them."""
    if isinstance(decoded, Observation) or not isinstance(decoded, dict):
        return {"name": None, "arguments": None}
    arguments = decoded.get("arguments", decoded.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = decode_json(arguments)
    return {"name": decoded.get("name"),
            "arguments": arguments if isinstance(arguments, dict) else None}


def reply_calls(text: str) -> list[dict]:
    """The calls of a reply, as the runtime's parser reads them (``<tool_call>`` blocks, a list in
    a block, or a bare call object as the whole reply)."""
    return [_as_call(decoded) for decoded in read_calls(text)[1]]


def message_calls(message: dict) -> list[dict]:
    """The calls of one assistant turn as the runtime stored it: its ``tool_calls``, else those
    its text holds (a turn whose calls could not be read keeps its text)."""
    if message.get("tool_calls"):
        return [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                for call in message["tool_calls"]]
    return reply_calls(message.get("content") or "")


def episode_calls(view: dict) -> list[dict]:
    """The calls of an episode's first reply: the last ``rounds`` + 1 assistant turns of its
    messages are the ones the model wrote; the first of them is its answer to the request."""
    written = [m for m in view["messages"] if m.get("role") == "assistant"][-(view["rounds"] + 1):]
    return message_calls(written[0]) if written else reply_calls(view["answer"])


def _decoded(value: Any, where: str) -> Any:
    """A cell stored as JSON text, decoded."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise UserError(f"a task row's '{where}' is text but not JSON") from None
    return value


def row_functions(tools: Any, functions: Any = None) -> list[dict]:
    """The functions a row offers, described BFCL's way: its ``functions`` column (BFCL's own
    descriptions, kept by ``evaluate-agent --bfcl``) when present, else its ``tools`` mapped."""
    if functions is not None:
        return _decoded(functions, "functions")
    return functions_from_tools(normalise_tools("tools", tools) or [])


def check_ground_truth(ground_truth: Any, functions: Sequence[dict],
                       where: str = "a task row") -> list[dict]:
    """The row's ground truth (BFCL's possible answer, decoded); one that is not a list of
    ``{function: {argument: [allowed]}}`` or names a function the row does not offer is a one-line
    UserError."""
    ground_truth = _decoded(ground_truth, "ground_truth")
    shaped = isinstance(ground_truth, list) and all(
        isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry.values())), dict)
        for entry in ground_truth)
    if not shaped:
        raise UserError(f"{where}: 'ground_truth' must be a list of {{function: {{argument: "
                        f"[allowed values]}}}} (BFCL's possible answer; [] for irrelevance)")
    missing = unknown_functions(ground_truth, functions)
    if missing:
        raise UserError(f"{where}: its ground truth names {missing[0]!r}, which is not among its "
                        "tools; offer that function in the row's 'tools' or fix the ground truth")
    return ground_truth


def _scores(score: Callable, completions, ground_truth, tools, category, functions, episodes) -> list[float]:
    results = []
    for index, completion in enumerate(completions):
        offered = row_functions(tools[index], None if functions is None else functions[index])
        expected = check_ground_truth(ground_truth[index], offered)
        calls = episode_calls(episodes[index]) if episodes is not None else reply_calls(completion)
        results.append(float(score(calls, expected, offered,
                                   None if category is None else category[index])))
    return results


def _match(calls, expected, offered, category) -> float:
    return 1.0 if check_calls(calls, expected, offered, category).ok else 0.0


def function_call_match(prompts, completions, ground_truth: Sequence[Any], tools: Sequence[Any],
                        category: Optional[Sequence[Optional[str]]] = None,
                        functions: Optional[Sequence[Any]] = None,
                        episodes: Optional[Sequence[dict]] = None, **_) -> list[float]:
    """1 when the reply's calls match the row's ``ground_truth`` by BFCL's AST rules
    (:func:`~slm_align.ondevice.rewards.function_match.check_calls`), else 0; in the irrelevance
    category (or with an empty ground truth) 1 for no call. Columns: ``ground_truth``, ``tools``
    (the offered functions), optionally ``category`` (order-free matching for parallel
    categories)."""
    return _scores(_match, completions, ground_truth, tools, category, functions, episodes)


function_call_match.columns = frozenset({"ground_truth", "tools"})


def function_call_graded(prompts, completions, ground_truth: Sequence[Any], tools: Sequence[Any],
                         category: Optional[Sequence[Optional[str]]] = None,
                         functions: Optional[Sequence[Any]] = None,
                         episodes: Optional[Sequence[dict]] = None, **_) -> list[float]:
    """Partial credit for shaping (:func:`~slm_align.ondevice.rewards.function_match.graded_score`):
    1 for a match, else the best pairing's share of right names, argument names and values, times
    0.9; irrelevance 1 or 0 as ``function_call_match``."""
    return _scores(graded_score, completions, ground_truth, tools, category, functions, episodes)


function_call_graded.columns = frozenset({"ground_truth", "tools"})


function_call_match.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)
function_call_graded.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)
