"""The task rows of ``feedback collect``: each rated turn as a task with its outcome, and the turns
rated up as demonstrations (the next round's SFT chats).

A thumbs verdict row (``prompt``, ``completion``, ``label``, ``model_id``, ``tools``; what
:func:`~slm_align.ondevice.agent.feedback_export.verdict_row` makes of a stored turn, or a line of a
``feedback export`` file) holds the whole turn: the store's ``messages`` are the conversation up to
the reply *and* the reply's tool rounds (each call the runtime ran and the tool's result),
``completion`` the final answer as the model wrote it. :func:`task_row` splits them back:

- ``prompt``: the messages up to the turn's last user message (what the user asked, with the history
  the runtime showed the model);
- ``completion``: the reply as messages, in OpenAI's form: its tool rounds as stored, then the final
  answer, its calls (``<tool_call>`` blocks, a bare call object) in ``tool_calls`` when every one
  reads as a call (``{"name", "arguments"}``), else as written;
- ``calls``: every call of the reply (``{"name", "arguments"}``; ``arguments`` None for one that
  could not be read), the rounds' first;
- ``results``: what the tools the runtime ran returned (``{"name", "content"}``, in order); empty
  when no tool ran in the runtime (a function-calling app runs the calls itself: ``reported``);
- ``reported``: what the app reported of running the reply's calls itself (``{"call", "ok",
  "content"}``, the latest per call; ``PreferenceStore.report_result``, schema version 5); empty
  when it reported nothing, and from export files;
- ``outcome``: 1 for a thumbs up, 0 for a thumbs down;
- the offered ``tools`` (as the runtime showed them) and the provenance ``model_id``, ``device``,
  ``arm``.

:func:`demonstration` makes a row rated up into a chat ``{"messages": prompt + completion,
"tools"}``, the format ``slm-align sft`` reads as ``data.path``: rejection-sampling fine-tuning
(expert iteration, Anthony et al. 2017; RAFT, Dong et al. 2023) on what the field rated up. Choices
and edits are no outcome of the turn alone and make no task row. Torch-free.
"""

from __future__ import annotations

from typing import Any, Sequence

from slm_align.errors import UserError
from slm_align.ondevice.rewards.function_calls import message_calls, reply_calls
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.parse import read_calls


def _last_user(messages: list) -> int:
    """The index of the last user message; -1 when there is none."""
    for index in range(len(messages) - 1, -1, -1):
        if isinstance(messages[index], dict) and messages[index].get("role") == "user":
            return index
    return -1


def _readable(calls: list[dict]) -> bool:
    return all(isinstance(call["name"], str) and isinstance(call["arguments"], dict)
               for call in calls)


def final_message(text: str) -> tuple[dict, list[dict]]:
    """The final answer as an assistant message and its calls: ``tool_calls`` (the text outside
    the calls in ``content``) when every call reads, else the text as written."""
    calls = reply_calls(text)
    if not calls or not _readable(calls):
        return {"role": "assistant", "content": text}, calls
    tool_calls = [ToolCall(call["name"], call["arguments"]).as_dict() for call in calls]
    message = {"role": "assistant", "content": read_calls(text)[0], "tool_calls": tool_calls}
    return message, calls


def task_row(row: dict[str, Any], reported: Sequence[dict] = ()) -> dict[str, Any]:
    """The task row of a thumbs verdict row (see the module docstring) and what the app
    ``reported`` of running its calls; the row's other columns (``model_id``, ``tools``,
    provenance) are kept as they are."""
    messages = list(row["prompt"])
    split = _last_user(messages) + 1 or len(messages)
    rounds = messages[split:]
    text = row["completion"][-1].get("content") or ""
    final, final_calls = final_message(text)
    calls = [call for message in rounds if message.get("role") == "assistant"
             for call in message_calls(message)]
    results = [{"name": message.get("name"), "content": message.get("content")}
               for message in rounds if message.get("role") == "tool"]
    kept = {key: value for key, value in row.items()
            if key not in ("prompt", "completion", "label")}
    return {"prompt": messages[:split], "completion": [*rounds, final],
            "calls": calls + final_calls, "results": results, "reported": list(reported),
            "outcome": int(bool(row["label"])), **kept}


def demonstration(task: dict[str, Any]) -> dict[str, Any] | None:
    """A task row rated up as an SFT chat (its provenance kept beside it); None for one rated
    down."""
    if not task["outcome"]:
        return None
    chat = {"messages": [*task["prompt"], *task["completion"]]}
    if task.get("tools"):
        chat["tools"] = task["tools"]
    provenance = {key: task.get(key) for key in ("model_id", "device", "arm")}
    return {**chat, "calls": len(task["calls"]), **provenance}


REFUSALS = ("balanced", "all")


def balanced(chats: list[dict], refusals: str = "balanced") -> list[dict]:
    """The demonstrations to train on: ``all``, or (``balanced``) every one that calls and,
    first come, at most as many that do not: thumbs up on answers without a call (right
    refusals, and wrong answers a user let pass) must not teach the model silence, as they
    taught KTO (docs/benchmarks.md, round two from the field)."""
    if refusals not in REFUSALS:
        raise UserError(f"refusals must be one of {', '.join(REFUSALS)}, got {refusals!r}")
    if refusals == "all":
        return list(chats)
    with_calls = [chat for chat in chats if chat["calls"]]
    without = [chat for chat in chats if not chat["calls"]]
    return with_calls + without[:len(with_calls)]
