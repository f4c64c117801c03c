"""The A/B rule on simulated thumbs whose true rates are known: it promotes a clearly better candidate,
reverts a clearly worse one, keeps collecting while undecided, and its measured false-decision rate is
within its stated bound."""

import math
import random

import pytest

from slm_align.ab_test import SequentialTest, decide

TEST = SequentialTest()


def thumbs(rate: float, n: int, rng: random.Random) -> list[bool]:
    return [rng.random() < rate for _ in range(n)]


def outcomes(rate_current: float, rate_candidate: float, runs: int = 1000, turns: int = 2000) -> dict[str, float]:
    rng = random.Random(f"{rate_current}-{rate_candidate}")
    counts = {"promote": 0, "revert": 0, "keep": 0, "collecting": 0}
    for _ in range(runs):
        counts[decide(thumbs(rate_current, turns, rng), thumbs(rate_candidate, turns, rng), TEST).decision] += 1
    return {key: value / runs for key, value in counts.items()}


def test_the_bounds_and_the_likelihood_ratio_by_hand():
    assert TEST.upper == pytest.approx(math.log(0.8 / 0.025))  # 3.466
    assert TEST.lower == pytest.approx(math.log(0.2 / 0.975))  # -1.584
    evidence = decide([False, True, True, False], [True, True, False, True])  # pairs: B, =, A, B
    assert (evidence.candidate_wins, evidence.current_wins) == (2, 1)
    assert evidence.llr_candidate_better == pytest.approx(2 * math.log(1.3) + math.log(0.7))
    assert evidence.llr_current_better == pytest.approx(math.log(1.3) + 2 * math.log(0.7))
    assert evidence.decision == "collecting" and evidence.current_rated == 4


def test_a_candidate_that_wins_every_discordant_pair_is_promoted_when_its_ratio_crosses_the_bound():
    wins_needed = math.ceil(TEST.upper / math.log(1 + 2 * TEST.delta))  # 14 straight wins
    evidence = decide([False] * 40, [True] * 40)
    assert evidence.decision == "promote" and evidence.candidate_wins == wins_needed
    assert decide([True] * 40, [False] * 40).decision == "revert"


def test_a_clearly_better_candidate_is_promoted_and_a_worse_one_reverted():
    better = outcomes(0.5, 0.75)
    assert better["promote"] >= 1 - TEST.beta and better["revert"] <= TEST.alpha
    worse = outcomes(0.75, 0.5)
    assert worse["revert"] >= 1 - TEST.beta and worse["promote"] <= TEST.alpha


def test_equal_arms_are_rarely_decided_wrongly_within_the_stated_bound():
    for rate in (0.2, 0.6):
        equal = outcomes(rate, rate)
        false = equal["promote"] + equal["revert"]
        assert false <= 2 * TEST.alpha + 3 * math.sqrt(2 * TEST.alpha / 1000)  # 5% stated, plus sampling noise
        assert equal["keep"] >= 0.9  # and it stops: the current one stays


def test_few_turns_keep_collecting():
    rng = random.Random(0)
    evidence = decide(thumbs(0.5, 6, rng), thumbs(0.6, 6, rng))
    assert evidence.decision == "collecting"
