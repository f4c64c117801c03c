"""What one RL iteration draws: how many prompts and completions (the seed of each
draw: envelope/seeds.py). Each algorithm says its own size (``Learner.iteration_size``).

Every draw of an iteration is seeded from (recipe seed, step, ...) alone, never from a running
generator, so a run resumed from a checkpoint draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

from dataclasses import dataclass


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

