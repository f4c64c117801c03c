"""What one RL iteration draws: how many prompts and completions (the seed of each
draw: envelope/seeds.py).

Every draw of an iteration is seeded from (recipe seed, step, ...) alone, never from a running
generator, so a run resumed from a checkpoint draws exactly what the uninterrupted run drew. No
torch here: the quickstart and the CLI import it to describe an iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from slm_align.config import RLSettings


@dataclass(frozen=True)
class IterationSize:
    """One iteration's draws: ``prompts`` distinct prompt draws, each sampled
    ``completions_per_prompt`` times."""

    prompts: int
    completions_per_prompt: int

    @property
    def samples(self) -> int:
        """Completions sampled, scored and trained on per iteration (across all ranks)."""
        return self.prompts * self.completions_per_prompt


def iteration_size(settings: RLSettings) -> IterationSize:
    """Both algorithms sample ``prompts_per_step * group_size`` completions an iteration.

    GRPO draws ``prompts_per_step`` prompts and samples each ``group_size`` times (a
    group); PPO draws ``prompts_per_step * group_size`` prompts and samples each once.
    Ranks share the prompt draws.
    """
    if settings.algo == "grpo":
        return IterationSize(settings.prompts_per_step, settings.group_size)
    return IterationSize(settings.prompts_per_step * settings.group_size, 1)
