"""Where RL, the headroom gate and evaluation take their prompts from, and the reward
that sees the data's columns.

Two sources: a task file (``data.tasks``: a prompt column and any other columns, split into train
and held-out without leaks), or the corpus (the openings of its documents, as before). With a task
file every column other than the prompt reaches the reward functions as a keyword list (TRL's
convention), looked up by prompt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional, Sequence

from slm_align.config import Recipe
from slm_align.data.corpus import load_corpus
from slm_align.data.prompts import prompts_of
from slm_align.data.tasks import read_tasks, split_tasks
from slm_align.errors import UserError
from slm_align.ondevice.rewards.builtin import combine
from slm_align.ondevice.rewards.columns import check_columns, with_columns
from slm_align.ondevice.rewards.protocol import RewardFn


@dataclass(frozen=True)
class PromptSource:
    """Training and held-out prompts, and the task rows behind them (None for
    corpus prompts: no columns)."""

    make_train: Callable[[], list[str]] = field(repr=False)
    """Builds the training prompts on first use (:attr:`train`): the gate and
    evaluation never need them."""
    heldout: list[str]
    description: str
    tasks: Optional[object] = None
    """Every task row (a ``slm_align.data.tasks.TaskSet``), for the columns' lookup by prompt."""
    heldout_answers: tuple[str, ...] = ()
    """The held-out tasks' ``answer`` column, when they have one."""

    @cached_property
    def train(self) -> list[str]:
        """The training prompts (rendering every training document's prompt only
        when RL asks for them)."""
        return self.make_train()

    def heldout_texts(self) -> list[str]:
        """Held-out prompts followed by their answers (when known): text for
        the prior's perplexity."""
        if not self.heldout_answers:
            return list(self.heldout)
        return [f"{prompt}{answer}" for prompt, answer in zip(self.heldout, self.heldout_answers)]

    def columns(self) -> set[str]:
        """The columns every task row has (empty for corpus prompts)."""
        if self.tasks is None:
            return set()
        return self.tasks.column_names()

    def reward(self, specs: Sequence[str] = (), learned: Optional[RewardFn] = None):
        """The combined reward (the learned reward model, already loaded, and/or specs), given
        the rows' columns; refused in one line before any sampling when a reward needs a column
        the data does not have."""
        reward = combine(specs, learned=learned)
        check_columns(reward, self.columns())
        if self.tasks is None:
            return reward
        return with_columns(reward, self.tasks)


def prompt_source(recipe: Recipe, tokenizer, corpus=None) -> PromptSource:
    """The task file's prompts when ``data.tasks`` is set, else the corpus's
    (``corpus`` reused when given)."""
    if recipe.data.tasks is not None:
        return _task_source(recipe, tokenizer)
    if corpus is None:
        corpus = load_corpus(recipe.data, recipe.seed)
    splits = corpus.splits
    make_train = functools.partial(prompts_of, splits.train, tokenizer)
    return PromptSource(make_train, prompts_of(splits.heldout, tokenizer), "openings of "
                                                                           f"{corpus.description}")


def _task_source(recipe: Recipe, tokenizer) -> PromptSource:
    path = Path(recipe.data.tasks)
    if not path.exists():
        raise UserError(f"task file {path} not found; pass an existing jsonl/json/parquet "
                        "file or datasets directory")
    tasks = read_tasks(path, tokenizer)
    train, heldout = split_tasks(tasks, recipe.seed, recipe.data.eval_fraction,
                                 recipe.data.heldout_prompts)
    if len(train) == 0 or len(heldout) < 2:
        raise UserError(f"task file {path}: {len(tasks)} distinct prompts are too few to split "
                        "into training and held-out prompts; give at least 20")
    answers = ()
    if "answer" in heldout.column_names():
        answers = tuple(str(row["answer"]) for row in heldout.columns)
    make_train = functools.partial(list, train.prompts)
    return PromptSource(make_train, list(heldout.prompts), f"tasks {path} ({len(tasks)} prompts)",
                        tasks, answers)
