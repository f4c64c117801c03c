"""A/B of a candidate adapter against the current one on users' thumbs, decided by a sequential test whose
error rates are stated: promote, revert, keep the current one (no difference), or keep collecting.

The test is Wald's sequential probability ratio test on *discordant pairs*. The k-th rated turn of the
current arm is paired with the k-th of the candidate's (each arm in the order its turns were rated); a pair
where exactly one side got a thumbs-up is discordant, and the candidate wins it with probability

    p = q_B (1 - q_A) / (q_B (1 - q_A) + q_A (1 - q_B)),

q_A and q_B the arms' true thumbs-up rates. p = 1/2 exactly when q_A = q_B, whatever the common rate, so
the null hypothesis is simple and Wald's bounds hold without knowing the base rate. Two one-sided SPRTs
run on the same pairs: "the candidate is better" (H0: p = 1/2 against H1: p = 1/2 + delta) and "the current
one is better" (p = 1/2 - delta). Each stops at log-likelihood ratio log((1 - beta) / alpha) (its H1) or
log(beta / (1 - alpha)) (its H0). With equal rates each promotes (or reverts) wrongly with probability at
most about alpha (Wald 1945, eq. 3.2; overshoot only lowers it), so a false decision happens with
probability at most about 2 alpha; a difference of delta in p is missed with probability about beta.

Standard library only: the runtime decides on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

DECISIONS = ("collecting", "promote", "revert", "keep")
"""collecting: no bound reached yet; promote: the candidate is better; revert: the current one is better;
keep: neither differs by delta (both one-sided tests accepted their H0): the current one stays."""


@dataclass(frozen=True)
class SequentialTest:
    """The test's settings; the defaults give a false promotion or revert at most about 5% of the time."""

    delta: float = 0.15
    """The smallest difference that matters, in p (the candidate's share of discordant pairs): 0.15 is
    q_A = 0.5 against q_B = 0.65."""
    alpha: float = 0.025
    """Each one-sided test's chance of a false decision when the arms are equal (2 alpha in all)."""
    beta: float = 0.2
    """Each one-sided test's chance of missing a difference of delta."""

    def __post_init__(self):
        if not 0 < self.delta < 0.5:
            raise ValueError(f"delta {self.delta}: must be between 0 and 0.5")
        if not 0 < self.alpha < 0.5 or not 0 < self.beta < 0.5:
            raise ValueError("alpha and beta must be between 0 and 0.5")

    @property
    def upper(self) -> float:
        """log((1 - beta) / alpha): a one-sided test accepts its H1 at or above it."""
        return math.log((1 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        """log(beta / (1 - alpha)): a one-sided test accepts its H0 at or below it."""
        return math.log(self.beta / (1 - self.alpha))


@dataclass(frozen=True)
class Evidence:
    """What a decision rests on: the pairs looked at (``*_rated``: each arm's turns among them, ``*_up`` their
    thumbs-up), the discordant pairs each side won, and the two log-likelihood ratios
    log L(p = 1/2 +- delta) / L(p = 1/2)."""

    decision: str
    current_up: int
    current_rated: int
    candidate_up: int
    candidate_rated: int
    candidate_wins: int
    current_wins: int
    llr_candidate_better: float
    llr_current_better: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def decide(current: Sequence[bool], candidate: Sequence[bool], test: SequentialTest = SequentialTest()) -> Evidence:
    """The decision on each arm's thumbs so far (True: up, in the order the turns were rated), as a device
    reaches it looking after every new pair: each one-sided test stops at its first bound (a direction that
    accepted its H0 stays accepted), and the walk stops at the first decision."""
    step_win = math.log(1 + 2 * test.delta)
    step_loss = math.log(1 - 2 * test.delta)
    better = worse = 0.0
    better_done = worse_done = False
    candidate_wins = current_wins = 0
    decision = "collecting"
    pairs = 0
    for a, b in zip(current, candidate):
        pairs += 1
        if a == b:
            continue
        candidate_wins += int(b)
        current_wins += int(a)
        better += step_win if b else step_loss
        worse += step_win if a else step_loss
        if not better_done and better >= test.upper:
            decision = "promote"
            break
        if not worse_done and worse >= test.upper:
            decision = "revert"
            break
        better_done = better_done or better <= test.lower
        worse_done = worse_done or worse <= test.lower
        if better_done and worse_done:
            decision = "keep"
            break
    return Evidence(decision, sum(current[:pairs]), pairs, sum(candidate[:pairs]), pairs, candidate_wins,
                    current_wins, better, worse)
