"""Rewards on agent episodes: ``task_success`` (the runtime's success rule), ``call_format`` (the
shaping term that keeps a small model calling tools) and ``environment_reward`` (an environment's
own ``get_reward()``), and the rule that classifies a finished episode, shared by RL and
``evaluate-agent`` so that training rewards what evaluation counts.

An episode reaches a reward as ``episodes=[{messages, calls, rounds, truncated, answer}, ...]``
(``calls``: ``{name, arguments, ok, content}`` each, as the runtime records them) and its
environment instance as ``environments=[...]``; the final answer is also the ``completion``. Single
completions (no episodes) are scored from the completion text alone.

A reward that can only score episodes says so with ``needs = "episodes"`` (or ``"environment"``:
every episode runs an environment); RL refuses it before training otherwise.

Torch-free, like the rest of the rewards.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from slm_align.errors import UserError
from slm_align.ondevice.rewards.answers import exact_answer

CATEGORIES = ("success", "no_call", "malformed_call", "wrong_tool", "wrong_answer")
"""What a finished episode is (:func:`classify`): the success, then each failure."""


def answers_match(text: str, answer: Any) -> bool:
    """The final answer in ``text`` equals ``answer`` (numbers by value): the rule of the
    ``exact_answer`` reward."""
    return exact_answer([""], [text], answer=[str(answer)])[0] == 1.0


def classify(calls: Sequence[dict], final_text: str, answer: Any,
             tool: Optional[str] = None) -> str:
    """The category of one finished episode.

    Args:
        calls: The runtime's record of the calls made (``Reply.tool_calls``: ``name``,
            ``arguments``, ``ok``); a call that could not be parsed has ``arguments`` None and
            ``ok`` False.
        final_text: The final reply.
        answer: The task's answer.
        tool: The tool the task needs (None: any tool will do).

    Returns ``success`` when the final answer is right (with or without a call); else ``no_call``;
    else ``wrong_answer`` when the right tool ran; else ``wrong_tool`` when another tool was named;
    else ``malformed_call`` (unparseable, or the tool refused its arguments).
    """
    if answers_match(final_text, answer):
        return "success"
    if not calls:
        return "no_call"
    if any(call["ok"] and (tool is None or call["name"] == tool) for call in calls):
        return "wrong_answer"
    if tool is not None and any(call["name"] and call["name"] != tool for call in calls):
        return "wrong_tool"
    return "malformed_call"


def task_success(prompts, completions, answer: Sequence[Any],
                 episodes: Optional[Sequence[dict]] = None, **_) -> list[float]:
    """1 when the final answer equals the row's ``answer`` (numbers by value), else 0: the
    success of ``evaluate-agent``. The final answer is the episode's last reply (with episodes) or
    the completion."""
    finals = [view["answer"] for view in episodes] if episodes is not None else list(completions)
    return [1.0 if answers_match(text, expected) else 0.0 for text, expected in zip(finals, answer)]


task_success.columns = frozenset({"answer"})
task_success.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)


def call_format(prompts, completions, episodes: Optional[Sequence[dict]] = None, **_) -> list[float]:
    """The share of an episode's tool calls that parsed, validated against the tool's schema and
    ran (0 for an episode without a call): a shaping term that rewards calling tools well, the
    remedy verl #1569 added by hand for tool-use collapse, and the term the watchdog raises when
    the call rate collapses. Needs episodes (``--episodes``): a single completion never runs its
    call."""
    if episodes is None:
        raise UserError("reward call_format scores agent episodes; train on task rows with tools "
                        "(--episodes on) or drop it")
    scores = []
    for view in episodes:
        calls = view["calls"]
        scores.append(sum(1.0 for call in calls if call["ok"]) / len(calls) if calls else 0.0)
    return scores


call_format.columns = frozenset()
call_format.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)
call_format.needs = "episodes"


def environment_reward(prompts, completions, environments: Optional[Sequence[Any]] = None, **_) -> list[float]:
    """Each episode's environment's own ``get_reward()`` (TRL's environment_factory convention):
    the environment judges the state the episode's calls left it in."""
    if environments is None or any(env is None or not callable(getattr(env, "get_reward", None))
                                   for env in environments):
        raise UserError("reward environment_reward needs every episode to run an environment with "
                        "a get_reward() method (--environment module:Class)")
    return [float(env.get_reward()) for env in environments]


environment_reward.columns = frozenset()
environment_reward.needs = "environment"
