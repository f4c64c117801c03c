"""Task columns for rewards (TRL's convention): each prompt's row reaches the reward as keyword
lists, and a reward that needs a column the data lacks is refused before any sampling.
"""

from __future__ import annotations

import functools
import inspect
from typing import Sequence

from slm_align.errors import UserError
from slm_align.ondevice.rewards.protocol import (
    CONTEXT_KEYS,
    CombinedReward,
    RewardFn,
    call_reward,
    reward_name,
)


class ColumnReward:
    """A reward that receives, for each prompt, its task row's columns as keyword lists
    (see :func:`with_columns`).

    Other attributes (``terms`` and ``scale_term`` of a :class:`CombinedReward`, ...) are the
    wrapped reward's.
    """

    def __init__(self, reward: RewardFn, tasks):
        self.reward = reward
        self.tasks = tasks
        self.__name__ = reward_name(reward)

    def __getattr__(self, name: str):
        if name in ("reward", "tasks") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.reward, name)

    def _context(self, prompts: list[str], context: dict) -> dict:
        columns = self.tasks.columns_for(prompts)
        clash = sorted(set(columns) & set(context))
        if clash:
            raise UserError(f"task column '{clash[0]}' has the name of an argument the trainer "
                            "passes to rewards; rename the column")
        return {**columns, **context}

    def __call__(self, prompts, completions, **context) -> Sequence[float]:
        """The wrapped reward's scores, given each prompt's columns as keyword
        lists besides ``context``."""
        prompts = list(prompts)
        return call_reward(self.reward, prompts, list(completions),
                           **self._context(prompts, context))


class _ColumnRewardWithBreakdown(ColumnReward):
    def breakdown(self, prompts, completions, **context) -> dict[str, list[float]]:
        """The wrapped reward's per-term scores, given each prompt's columns."""
        prompts = list(prompts)
        return self.reward.breakdown(prompts, list(completions), **self._context(prompts, context))


def with_columns(reward_fn: RewardFn, tasks) -> ColumnReward:
    """``reward_fn`` called with each prompt's task columns (TRL's convention).

    ``tasks`` is a :class:`slm_align.data.tasks.TaskSet`; prompts may repeat (GRPO's groups) and
    come in any order or subset; each is looked up by its text, and one that is not in ``tasks`` is
    a UserError. The result calls ``reward_fn(prompts, completions, **columns, **context)``
    (``context``: what the caller passes, such as ``truncated=``), leaving out columns a function
    without ``**kwargs`` does not take; ``breakdown`` stays available when ``reward_fn`` has one.
    """
    kind = _ColumnRewardWithBreakdown if hasattr(reward_fn, "breakdown") else ColumnReward
    return kind(reward_fn, tasks)


def _required_keywords(fn: RewardFn) -> set[str]:
    """Parameters without defaults after the first two positional ones (prompts, completions)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return set()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    skipped = {p.name for p in positional[:2]}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.name not in skipped and p.kind in named
            and p.default is p.empty}


def required_columns(reward_fn: RewardFn) -> set[str]:
    """The task columns a reward needs: its keyword parameters without defaults (besides prompts,
    completions and what callers pass, such as ``truncated``) and its ``columns`` attribute (the
    built-ins declare theirs); a
    :class:`CombinedReward` needs what its terms need."""
    if isinstance(reward_fn, ColumnReward):
        return required_columns(reward_fn.reward)
    if isinstance(reward_fn, CombinedReward):
        return set().union(*(required_columns(fn) for _, fn, _ in reward_fn.terms))
    if isinstance(reward_fn, functools.partial):
        return required_columns(reward_fn.func) - set(reward_fn.keywords)
    declared = getattr(reward_fn, "columns", None)
    names = set(declared) if isinstance(declared, (set, frozenset)) else set()
    return (names | _required_keywords(reward_fn)) - CONTEXT_KEYS


def named_terms(reward_fn: RewardFn) -> list[tuple[str, RewardFn]]:
    """Each term of a reward with its name (one term for a plain function)."""
    if isinstance(reward_fn, ColumnReward):
        return named_terms(reward_fn.reward)
    if isinstance(reward_fn, CombinedReward):
        return [(name, fn) for name, fn, _ in reward_fn.terms]
    return [(reward_name(reward_fn), reward_fn)]


def check_columns(reward_fn: RewardFn, available) -> None:
    """A one-line UserError naming each reward term whose columns the task data lacks,
    and the columns it has."""
    available = set(available)
    problems = []
    for name, fn in named_terms(reward_fn):
        missing = sorted(required_columns(fn) - available)
        if missing:
            problems.append(f"reward {name} needs column{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(missing)}")
    if problems:
        has = ", ".join(sorted(available)) or "none besides the prompt"
        raise UserError(f"{'; '.join(problems)}, which the task data lacks in some or all rows "
                        f"(its columns: {has}); add them to every row or drop the reward")
