"""The A/B rule on simulated users whose true rates are known (issue 45, items 5 and 6): conversations are
randomised, several turns of one conversation are rated alike (a conversation-level rate) and unhappy users
rate more; the rule counts each conversation's first verdict, pairs in time order, caps each client, and
its measured error rates hold: false decisions at most 5% with equal arms (drift and unequal shares
included), at least 80% found at the design delta, and one client alone never decides."""

import math
import random

import pytest

from slm_align.ondevice.agent.ab_sequential import Observation, SequentialTest, decide, pairs_in_time

TEST = SequentialTest()
CONCENTRATION = 2.0
"""Beta(m k, (1 - m) k) conversation-level thumbs-up rates: strongly correlated turns."""


def rated_rate(mean: float) -> float:
    """The thumbs-up rate of a rated conversation's first verdict when the conversation's rate u is
    Beta(mean k, (1 - mean) k) and it is rated with probability 0.2 + 0.6 (1 - u):
    E[u (0.2 + 0.6 (1 - u))] / E[0.2 + 0.6 (1 - u)], E[u^2] = m (1 - m) / (k + 1) + m^2."""
    second = mean * (1 - mean) / (CONCENTRATION + 1) + mean ** 2
    return (0.8 * mean - 0.6 * second) / (0.8 - 0.6 * mean)


def mean_for(rate: float) -> float:
    """The conversation-level mean whose rated conversations give ``rate`` (bisection)."""
    low, high = 1e-6, 1 - 1e-6
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if rated_rate(middle) < rate else (low, middle)
    return (low + high) / 2


def conversations(rng: random.Random, means: dict, share: float, n: int, clients: int = 300,
                  drift: float = 0.0) -> list[Observation]:
    """Every verdict of ``n`` routed conversations (a client each from a pool, heavy users first), each
    conversation's turns rated at its own rate, later turns later; ``drift`` adds to both arms' means
    over the run."""
    found = []
    for i in range(n):
        arm = "candidate" if rng.random() < share else "current"
        mean = min(max(means[arm] + drift * (i / n - 0.5), 0.02), 0.98)
        rate = rng.betavariate(mean * CONCENTRATION, (1 - mean) * CONCENTRATION)
        if rng.random() > 0.2 + 0.6 * (1 - rate):
            continue  # not rated at all
        client = f"client-{min(int(rng.expovariate(1 / 40)), clients)}"
        for turn in range(1 + sum(rng.random() < 1 - rate for _ in range(4))):
            found.append(Observation(arm, rng.random() < rate, f"c{i}", f"{i + 3 * turn:08d}", client))
    return found


def outcomes(rates: dict, share: float = 0.5, runs: int = 300, n: int = 2000, drift: float = 0.0) -> dict:
    rng = random.Random(f"{rates}-{share}-{drift}")
    means = {arm: mean_for(rate) for arm, rate in rates.items()}
    counts = dict.fromkeys(("promote", "revert", "keep", "collecting"), 0)
    for _ in range(runs):
        counts[decide(conversations(rng, means, share, n, drift=drift), TEST).decision] += 1
    return {key: value / runs for key, value in counts.items()}


def p_of(current: float, candidate: float) -> float:
    return candidate * (1 - current) / (candidate * (1 - current) + current * (1 - candidate))


def test_the_bounds_and_the_likelihood_ratio_by_hand():
    assert TEST.upper == pytest.approx(math.log(1 / 0.025))  # Ville: 3.689
    assert TEST.lower == pytest.approx(math.log(0.1 / 0.975))
    thumbs = [("current", False), ("candidate", True), ("current", True), ("candidate", True),
              ("current", True), ("candidate", False), ("candidate", True), ("current", False)]
    observations = [Observation(arm, up, f"c{i}", f"{i:02d}", f"u{i}") for i, (arm, up) in enumerate(thumbs)]
    evidence = decide(observations)  # pairs in time order: (F, T), (T, T), (T, F), (F, T)
    assert (evidence.pairs, evidence.candidate_wins, evidence.current_wins) == (4, 2, 1)
    assert evidence.llr_candidate_better == pytest.approx(2 * math.log(1.3) + math.log(0.7))
    assert evidence.llr_current_better == pytest.approx(math.log(1.3) + 2 * math.log(0.7))
    assert evidence.decision == "collecting" and evidence.conversations == 8 == evidence.clients


def test_one_observation_per_conversation_its_first_verdict():
    """Later turns and re-votes of a conversation change nothing: 30 ups after a down stay one down."""
    base = [Observation("current", True, f"a{i}", f"{i:03d}", f"u{i}") for i in range(30)]
    base += [Observation("candidate", False, f"b{i}", f"{i:03d}", f"v{i}") for i in range(30)]
    later = [Observation("candidate", True, f"b{i}", f"{100 + i:03d}", f"v{i}") for i in range(30)]
    assert decide(base + later).to_dict() == decide(base).to_dict()
    assert decide(base).candidate_up == 0


def test_pairs_form_in_time_order_and_stale_waiters_drop_out():
    """With shares 9 to 1 the candidate's rare conversations pair with the newest current ones, not with
    the k-th current conversation from long before."""
    observations = [Observation("candidate" if i % 10 == 9 else "current", True, f"c{i}", f"{i:03d}")
                    for i in range(100)]
    pairs = pairs_in_time(observations, window=4)
    assert len(pairs) == 10
    assert all(int(candidate.at) - int(current.at) <= 4 for current, candidate in pairs)


def test_equal_arms_are_decided_wrongly_at_most_5_percent_under_correlated_turns():
    for rate, share, drift in ((0.6, 0.5, 0.0), (0.3, 0.5, 0.0), (0.5, 0.2, 0.5)):
        equal = outcomes({"current": rate, "candidate": rate}, share=share, drift=drift)
        assert equal["promote"] + equal["revert"] <= 2 * TEST.alpha, (rate, share, drift, equal)


def test_a_candidate_better_by_delta_is_promoted_at_least_80_percent_and_a_worse_one_reverted():
    current = 0.5
    candidate = 0.65
    assert p_of(current, candidate) == pytest.approx(0.5 + TEST.delta)  # the design delta exactly
    better = outcomes({"current": current, "candidate": candidate}, runs=200, n=3000)
    assert better["promote"] >= 0.8 and better["revert"] == 0, better
    worse = outcomes({"current": candidate, "candidate": current}, runs=200, n=3000)
    assert worse["revert"] >= 0.8 and worse["promote"] == 0, worse


def test_one_client_cannot_reach_a_decision():
    """The issue's reproduction as observations: one client rates every candidate answer up and every
    current one down, over 1,000 conversations; a second client too few to reach the minimum."""
    one = [Observation("candidate" if i % 2 else "current", bool(i % 2), f"c{i}", f"{i:05d}", "attacker")
           for i in range(1000)]
    evidence = decide(one)
    assert evidence.decision == "collecting" and evidence.conversations == TEST.max_per_client
    assert evidence.capped == 1000 - TEST.max_per_client
    two = one + [Observation(o.arm, o.up, o.conversation + "x", o.at + "x", "second") for o in one]
    assert decide(two).decision == "collecting"
    uncapped = SequentialTest(max_per_client=None)
    assert decide(one, uncapped).decision == "promote"  # the cap is what holds


def test_each_source_is_capped_and_paired_apart():
    """Pooled over devices: a device's conversations pair among themselves, and one device counts at
    most ``max_per_source`` of them."""
    fleet = SequentialTest(max_per_source=20, max_per_client=None)
    loud = [Observation("candidate" if i % 2 else "current", bool(i % 2), f"c{i}", f"{i:05d}", source="loud")
            for i in range(500)]
    assert decide(loud, fleet).decision == "collecting"
    assert decide(loud, fleet).conversations == 20
    mixed = [Observation("current", True, "a", "1", source="one"), Observation("candidate", False, "b", "2",
                                                                               source="two")]
    assert pairs_in_time(mixed, 4) == []


def test_few_conversations_keep_collecting_even_past_a_bound():
    """15 straight discordant wins cross the bound, but 30 conversations are below the minimum."""
    observations = [Observation("candidate" if i % 2 else "current", bool(i % 2), f"c{i}", f"{i:03d}", f"u{i}")
                    for i in range(30)]
    evidence = decide(observations)
    assert evidence.llr_candidate_better > TEST.upper and evidence.decision == "collecting"
    more = [Observation(o.arm, o.up, o.conversation + "+", "1" + o.at, "w" + o.client) for o in observations]
    assert decide(observations + more).decision == "promote"
