"""The built-in rewards by name (``--reward NAME[@weight]``), user rewards as
``module:function[@weight]``, and
:func:`combine`, which makes one reward of them.
"""

from __future__ import annotations

from typing import Optional, Sequence

from slm_align.config.named import import_named
from slm_align.errors import UserError
from slm_align.ondevice.rewards.answers import exact_answer
from slm_align.ondevice.rewards.episodes import call_format, environment_reward, task_success
from slm_align.ondevice.rewards.function_calls import function_call_graded, function_call_match
from slm_align.ondevice.rewards.protocol import CombinedReward, RewardFn
from slm_align.ondevice.rewards.tool_calls import json_tool_call, tool_task


def length_window(prompts, completions, min_words: int = 20, max_words: int = 80, **_) -> list[float]:
    """1 inside ``[min_words, max_words]``, falling linearly to 0 at no words and
    at twice ``max_words``."""
    scores = []
    for completion in completions:
        n = len(completion.split())
        if n < min_words:
            scores.append(n / min_words)
        elif n <= max_words:
            scores.append(1.0)
        else:
            scores.append(max(0.0, 1.0 - (n - max_words) / max_words))
    return scores


length_window.columns = frozenset()
length_window.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)

BUILTINS: dict[str, RewardFn] = {"length_window": length_window, "exact_answer": exact_answer,
                                 "json_tool_call": json_tool_call, "tool_task": tool_task,
                                 "task_success": task_success, "call_format": call_format,
                                 "environment_reward": environment_reward,
                                 "function_call_match": function_call_match,
                                 "function_call_graded": function_call_graded}


def load_reward_fn(spec: str) -> tuple[str, RewardFn, float]:
    """``name``, the callable and its weight for ``module:function[@weight]``
    or ``builtin[@weight]``."""
    target, _, weight_text = spec.partition("@")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise UserError(f"reward {spec}: weight {weight_text!r} is not a number (use "
                        f"module:function@0.5)") from None
    if target in BUILTINS:
        return target, BUILTINS[target], weight
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise UserError(f"reward {spec}: use module:function, or one of {', '.join(BUILTINS)}")
    fn = import_named(target, "reward")
    if not callable(fn):
        raise UserError(f"reward {spec}: {attribute} is not callable")
    return target, fn, weight


def combine(specs: Sequence[str] = (), learned: Optional[RewardFn] = None, learned_weight: float = 1.0,
            callables: Sequence[tuple[RewardFn, float]] = ()) -> CombinedReward:
    """The learned reward model (a callable,
    :class:`slm_align.scoring.learned_reward.LearnedReward`), CLI specs and Python callables as one
    reward."""
    terms: list[tuple[str, RewardFn, float]] = []
    if learned is not None:
        terms.append(("reward_model", learned, learned_weight))
    terms += [load_reward_fn(spec) for spec in specs]
    terms += [(getattr(fn, "__name__", type(fn).__name__), fn, weight) for fn, weight in callables]
    if not terms:
        raise UserError("no reward: train a reward model (`slm-align train --stage "
                        "reward`) or pass --reward")
    return CombinedReward(terms)
