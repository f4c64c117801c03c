"""The seed streams every random draw is seeded from: the formulas of the first release."""

from slm_align.envelope.seeds import SEED_STREAMS, derive_seed


def test_seed_streams_are_the_formulas_of_the_first_release():
    """The quickstart's figures for a fixed seed depend on these integers: they must never move."""
    seed, step, rank, epoch = 42, 7, 1, 1
    assert derive_seed(seed, "prompts", step) == seed * 1_000_003 + step
    assert derive_seed(seed, "rollout", step, rank) == seed * 7919 + step + 100_003 * rank
    assert derive_seed(seed, "resample", step, rank) == seed * 7919 + step + 100_003 * rank + 104729
    assert derive_seed(seed, "minibatch_order", step, epoch=epoch) == seed * 31 + step * 1009 + epoch
    assert derive_seed(seed, "preference_order", 0, epoch=epoch) == seed * 37 + epoch * 1013  # DPO/KTO, added later
    # GRPO's refill of all-equal groups (rl.grpo.refill_flat), added later: the round is the epoch slot
    assert derive_seed(seed, "refill_prompts", step, rank, epoch) == (seed * 1_000_003 + step + 100_003 * rank
                                                                      + 1013 * epoch + 15_485_863)
    assert derive_seed(seed, "refill", step, rank, epoch) == (seed * 7919 + step + 100_003 * rank
                                                              + 1013 * epoch + 32_452_843)
    assert set(SEED_STREAMS) == {"prompts", "rollout", "resample", "minibatch_order", "preference_order",
                                 "refill_prompts", "refill"}


def test_no_two_streams_seed_the_same_draw():
    """A refill round's prompts or samples never reuse another stream's seed at the same (seed, step, rank) over
    the rounds and ranks a run can have."""
    seed = 42
    for step in range(64):
        seen = {}
        for stream in SEED_STREAMS:
            for rank in range(8):
                for epoch in range(9):
                    value = derive_seed(seed, stream, step, rank, epoch)
                    assert seen.setdefault(value, stream) == stream, (stream, seen[value], step, rank, epoch)
