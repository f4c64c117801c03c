"""The reward protocol: anything that scores (prompt, completion) batches.

A reward is a callable ``fn(prompts, completions, **context) -> list[float]``. Following TRL, every
column of the task data other than the prompt arrives as a keyword list aligned with the completions
(``fn(prompts, completions, answer=[...], tools=[...], **rest)``: see
:mod:`slm_align.ondevice.rewards.columns`); ``context`` may also carry ``references`` (reference
answers of prompt/completion data) and, for sampled completions, ``truncated`` (one bool each: the
completion hit the token budget without EOS) and, for agent episodes, ``episodes`` and
``environments`` (see :mod:`slm_align.ondevice.rewards.episodes`). A keyword parameter without a
default (or a ``columns`` attribute, as the built-ins have) names a column the reward needs.
:class:`CombinedReward` sums weighted terms.

Torch-free: the runtime scores tasks with these functions on a device.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from slm_align.errors import UserError

RewardFn = Callable[..., Sequence[float]]

# Keywords the callers pass themselves: never columns a reward can require.
CONTEXT_KEYS = frozenset({"truncated", "references", "episodes", "environments"})


def _accepted(fn: RewardFn, context: dict) -> dict:
    """The keywords of ``context`` that ``fn`` takes (all of them when it has ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return context
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return context
    return {key: value for key, value in context.items() if key in parameters}


def call_reward(fn: RewardFn, prompts, completions, **context) -> Sequence[float]:
    """``fn(prompts, completions, **context)``, leaving out the keywords
    (columns) it does not take."""
    return fn(prompts, completions, **_accepted(fn, context))


def reward_bounds(fn: RewardFn) -> Optional[tuple[float, float]]:
    """A reward's worst and best score: its ``bounds`` attribute (the built-ins have one), for a
    :class:`CombinedReward` the weighted sum of its terms' (a negative weight swaps a term's ends);
    None when any is unknown (a learned reward model, a user function without ``bounds``)."""
    terms = getattr(fn, "terms", None)
    if terms is None:
        bounds = getattr(fn, "bounds", None)
        return None if bounds is None else (float(bounds[0]), float(bounds[1]))
    low = high = 0.0
    for _, term, weight in terms:
        bounds = reward_bounds(term)
        if bounds is None:
            return None
        ends = sorted((weight * bounds[0], weight * bounds[1]))
        low += ends[0]
        high += ends[1]
    return low, high


def reward_name(fn: RewardFn) -> str:
    """A reward's name for messages: its function name, or its class name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


@dataclass
class CombinedReward:
    """Weighted sum of named reward functions; :meth:`breakdown` keeps each term for logging."""

    terms: list[tuple[str, RewardFn, float]]
    base_weights: dict[str, float] = field(init=False, repr=False, compare=False)
    """Each term's weight at construction: what :meth:`scale_term` scales."""

    def __post_init__(self):
        self.base_weights = {name: weight for name, _, weight in self.terms}

    def scale_term(self, name: str, factor: float) -> None:
        """Weigh term ``name`` at ``factor`` times its weight at construction (the watchdog's
        call-format shaping after a tool-use collapse); a name with no term: nothing."""
        if name not in self.base_weights:
            return
        self.terms = [(term, fn, self.base_weights[term] * factor if term == name else weight)
                      for term, fn, weight in self.terms]

    def breakdown(self, prompts, completions, **context) -> dict[str, list[float]]:
        parts = {}
        for name, fn, _ in self.terms:
            scores = [float(s) for s in call_reward(fn, list(prompts), list(completions),
                                                    **context)]
            if len(scores) != len(completions):
                raise UserError(f"reward {name} returned {len(scores)} scores for "
                                f"{len(completions)} completions")
            parts[name] = scores
        return parts

    def __call__(self, prompts, completions, **context) -> list[float]:
        parts = self.breakdown(prompts, completions, **context)
        weights = {name: weight for name, _, weight in self.terms}
        return [sum(weights[name] * parts[name][i] for name in parts)
                for i in range(len(completions))]

