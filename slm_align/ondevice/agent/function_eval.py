"""Function-calling task rows in ``evaluate-agent``: the generated rows of ``tasks make --kind
functions`` and BFCL's entries (:mod:`slm_align.ondevice.agent.bfcl`), scored by BFCL's rules.

A function row (one with ``ground_truth``: see the row format in docs/tool-use.md) is answered in
one reply: the chat template renders the row's messages and its ``tools``, the model writes its
reply without a grammar (as RL episodes sample), and the runtime's parser reads the reply's calls;
the calls are the answer, nothing runs. :func:`~slm_align.ondevice.rewards.function_match.check_calls`
judges them (the rule the ``function_call_match`` reward applies), and a failure falls in the
categories of ``evaluate-agent`` (no call, malformed call, wrong tool (a call in irrelevance
included), wrong answer (arguments or number of calls)). Accuracy per row category comes with its
Wilson interval. Torch-free.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from slm_align.errors import UserError
from slm_align.ondevice.rewards.function_calls import check_ground_truth, reply_calls, row_functions
from slm_align.ondevice.rewards.function_match import Verdict, call_name, check_calls
from slm_align.ondevice.tools.registry import ToolRegistry
from slm_align.ondevice.tools.specs import normalise_tools, registry_for_row
from slm_align.stats import wilson_interval


def is_function_row(row) -> bool:
    """A function-calling task row: it has a ``ground_truth``."""
    return isinstance(row, dict) and "ground_truth" in row


def function_messages(row: dict) -> list[dict]:
    """The chat a function row starts from: its ``messages`` (or a text ``prompt`` as one user
    message)."""
    messages = row.get("messages", row.get("prompt"))
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages):
        return [dict(m) for m in messages]
    raise UserError("a function task row needs 'messages', a list of {role, content} messages")


def check_function_row(where: str, row: dict) -> None:
    """Refuse a function row without messages or tools, or whose ground truth is malformed or names
    a function it does not offer (one-line UserError)."""
    try:
        function_messages(row)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    if not normalise_tools(where, row.get("tools")):
        raise UserError(f"{where}: a function task row needs 'tools' (the functions offered)")
    check_ground_truth(row["ground_truth"], row_functions(row["tools"], row.get("functions")), where)


def function_registry(row: dict) -> ToolRegistry:
    """The row's tools as the runtime offers them (none of them runs here)."""
    return registry_for_row(row["tools"], ToolRegistry())


def judge_reply(row: dict, text: str) -> tuple[Verdict, list[dict]]:
    """The verdict on a reply's calls, and the calls."""
    calls = reply_calls(text)
    functions = row_functions(row["tools"], row.get("functions"))
    ground_truth = check_ground_truth(row["ground_truth"], functions)
    return check_calls(calls, ground_truth, functions, row.get("category")), calls


def valid_calls(row: dict, calls: Sequence[dict]) -> int:
    """Calls that parsed and name an offered function."""
    offered = {call_name(function) for function in row_functions(row["tools"], row.get("functions"))}
    return sum(1 for call in calls if isinstance(call["arguments"], dict) and call["name"] in offered)


def answer_text(row: dict) -> str:
    """A function row's answer for the report: its ground truth as JSON."""
    return json.dumps(row["ground_truth"], ensure_ascii=False)


def category_figures(results: Sequence) -> Optional[dict]:
    """Per row category (``group``): tasks, successes, accuracy and its Wilson 95% interval; None
    when no result has a category."""
    groups: dict[str, list[bool]] = {}
    for result in results:
        if result.group:
            groups.setdefault(result.group, []).append(result.success)
    if not groups:
        return None
    return {group: {"episodes": len(wins), "successes": sum(wins), "accuracy": sum(wins) / len(wins),
                    "ci95": list(wilson_interval(sum(wins), len(wins)))} for group, wins in groups.items()}
