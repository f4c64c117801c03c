"""The seed of each random draw of a run (RL and preference optimisation).

Every draw is seeded from (recipe seed, step, ...) alone, never from a running generator, so a run
resumed from a checkpoint draws exactly what the uninterrupted run drew. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeedStream:
    """Multipliers of one stream: seed = seed_x * seed + step_x * step + rank_x * rank +
    epoch_x * epoch + offset."""

    seed_x: int
    step_x: int = 1
    rank_x: int = 0
    epoch_x: int = 0
    offset: int = 0


SEED_STREAMS = {
    # stream             seed        step   rank     epoch  offset
    "prompts": SeedStream(1_000_003, 1, 0, 0, 0),  # which training prompts an iteration uses (same on every rank)
    "rollout": SeedStream(7919, 1, 100_003, 0, 0),  # the sampler of this rank's completions
    "resample": SeedStream(7919, 1, 100_003, 0, 104_729),  # GRPO's second draw of its all-equal groups
    "refill_prompts": SeedStream(1_000_003, 1, 100_003, 1013, 15_485_863),  # GRPO's new prompts for all-equal groups
    "refill": SeedStream(7919, 1, 100_003, 1013, 32_452_843),  # the sampler of those new prompts' completions
    "minibatch_order": SeedStream(31, 1009, 0, 1, 0),  # the shuffle of the rollout before each epoch
    "preference_order": SeedStream(37, 0, 0, 1013, 0),  # DPO/KTO: the shuffle of the training items per epoch
}
"""The random draws of a run and their multipliers (primes, so that streams rarely
collide). Changing one changes every figure of a seeded run (the quickstart's included):
add a stream, never edit one."""


def derive_seed(seed: int, stream: str, step: int, rank: int = 0, epoch: int = 0) -> int:
    """The seed of one random draw: ``stream`` of :data:`SEED_STREAMS` at (``seed``,
    ``step``, ``rank``, ``epoch``).

    For example ``derive_seed(seed, "prompts", step=3)`` is ``seed * 1_000_003 + 3``.
    """
    s = SEED_STREAMS[stream]
    return s.seed_x * seed + s.step_x * step + s.rank_x * rank + s.epoch_x * epoch + s.offset
