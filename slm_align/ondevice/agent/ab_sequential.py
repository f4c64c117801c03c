"""A/B of a candidate adapter against the current one on users' thumbs, decided by a sequential test whose
error rates are stated: promote, revert, keep the current one (no difference), or keep collecting.

The unit is the conversation, as the router randomises conversations: each conversation that the trial
routed gives ONE observation, its first verdict (up or down); later turns and re-votes add nothing, so turns
of one user, correlated with each other, never count as independent evidence. Observations are taken in
time order, at most ``max_per_client`` from one client (and ``max_per_source`` from one device, pooled
over a fleet), and paired in time order within each source: an observation pairs with the oldest waiting
one of the other arm, and an arm keeps at most ``window`` waiting (a newer one pushes the oldest out), so
the two sides of a pair are close in time even when the arms' shares differ or the base rate drifts.

On those pairs runs Wald's sequential probability ratio test on *discordant pairs*: a pair where exactly
one side got a thumbs-up, which the candidate wins with probability

    p = q_B (1 - q_A) / (q_B (1 - q_A) + q_A (1 - q_B)),

q_A and q_B the arms' true thumbs-up rates at that time. p = 1/2 exactly when q_A = q_B, whatever the
common rate, so the null hypothesis is simple and needs no base rate. Two one-sided SPRTs run on the same
pairs: "the candidate is better" (H0: p = 1/2 against H1: p = 1/2 + delta) and "the current one is better"
(p = 1/2 - delta). Each accepts its H1 at log-likelihood ratio log(1 / alpha) and its H0 at
log(beta / (1 - alpha)). Under p = 1/2 the likelihood ratio is a martingale of mean 1, so by Ville's
inequality it ever reaches 1 / alpha with probability at most alpha, however long the test runs and
however late it first looks (Wald's log((1 - beta) / alpha) only holds approximately, and not after a
delayed first look). A false promote or revert thus happens with probability at most 2 alpha; a
difference of delta in p is found with probability about 1 - beta (Wald 1945). No decision is taken
before ``min_conversations`` conversations are in pairs: with ``max_per_client`` below it, one client
alone can never decide.

Standard library only: the runtime decides on the device. Written here rather than taken from a library:
the sequential libraries we know (``statsmodels``, ``scipy``) test fixed samples, not this rule.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, Optional

DECISIONS = ("collecting", "promote", "revert", "keep")
"""collecting: no bound reached yet; promote: the candidate is better; revert: the current one is better;
keep: neither differs by delta (both one-sided tests accepted their H0): the current one stays."""
ARMS = ("current", "candidate")


@dataclass(frozen=True)
class SequentialTest:
    """The test's settings; the defaults give a false promotion or revert at most 5% of the time."""

    delta: float = 0.15
    """The smallest difference that matters, in p (the candidate's share of discordant pairs): 0.15 is
    q_A = 0.5 against q_B = 0.65."""
    alpha: float = 0.025
    """Each one-sided test's chance of a false decision when the arms are equal (2 alpha in all)."""
    beta: float = 0.1
    """Each one-sided test's chance of missing a difference of delta (about)."""
    min_conversations: int = 40
    """No decision before this many conversations are in pairs."""
    max_per_client: Optional[int] = 10
    """Most conversations one client counts with (None: no cap); below ``min_conversations``, so that one
    client alone cannot decide."""
    max_per_source: Optional[int] = None
    """Most conversations one source (a device's store, pooled over a fleet) counts with (None: no cap)."""
    window: int = 4
    """Most observations of one arm waiting for a partner (a newer one pushes the oldest out)."""

    def __post_init__(self):
        if not 0 < self.delta < 0.5:
            raise ValueError(f"delta {self.delta}: must be between 0 and 0.5")
        if not 0 < self.alpha < 0.5 or not 0 < self.beta < 0.5:
            raise ValueError("alpha and beta must be between 0 and 0.5")
        if self.min_conversations < 2 or self.window < 1:
            raise ValueError("min_conversations must be at least 2 and window at least 1")
        for cap in (self.max_per_client, self.max_per_source):
            if cap is not None and cap < 1:
                raise ValueError(f"a cap of {cap} conversations admits nothing: pass 1 or more, or None")

    @property
    def upper(self) -> float:
        """log(1 / alpha): a one-sided test accepts its H1 at or above it (Ville's bound)."""
        return math.log(1 / self.alpha)

    @property
    def lower(self) -> float:
        """log(beta / (1 - alpha)): a one-sided test accepts its H0 at or below it."""
        return math.log(self.beta / (1 - self.alpha))


@dataclass(frozen=True)
class Observation:
    """One verdict on a turn the trial routed; :func:`decide` keeps each conversation's first."""

    arm: str
    """'current' or 'candidate': the arm the router gave the conversation."""
    up: bool
    conversation: str
    at: str
    """When the verdict was given, sortable (ISO 8601 UTC)."""
    client: str = ""
    """Who sent it (a server: a pseudonym of the peer's address)."""
    source: str = ""
    """Which store (device) it comes from."""


@dataclass(frozen=True)
class Evidence:
    """What a decision rests on: the conversations admitted and paired, each arm's paired conversations
    (``*_rated``) and their thumbs-up (``*_up``), the discordant pairs each side won, and the two
    log-likelihood ratios log L(p = 1/2 +- delta) / L(p = 1/2)."""

    decision: str
    conversations: int
    clients: int
    capped: int
    """Conversations left out by a cap."""
    pairs: int
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


def first_verdicts(observations: Iterable[Observation]) -> list[Observation]:
    """Each conversation's first observation (of its source), in time order."""
    ordered = sorted(observations, key=_time_order)
    seen: set = set()
    first = []
    for each in ordered:
        key = (each.source, each.conversation)
        if key not in seen:
            seen.add(key)
            first.append(each)
    return first


def _time_order(observation: Observation) -> tuple[str, str, str]:
    return observation.at, observation.source, observation.conversation


def admitted(observations: list[Observation], test: SequentialTest) -> tuple[list[Observation], int]:
    """The observations within the caps (the first ones of each client and source, in time order), and
    how many the caps left out."""
    per_client: Counter = Counter()
    per_source: Counter = Counter()
    kept = []
    for each in observations:
        client = (each.source, each.client)
        if test.max_per_client is not None and per_client[client] >= test.max_per_client:
            continue
        if test.max_per_source is not None and per_source[each.source] >= test.max_per_source:
            continue
        per_client[client] += 1
        per_source[each.source] += 1
        kept.append(each)
    return kept, len(observations) - len(kept)


def pairs_in_time(observations: list[Observation], window: int) -> list[tuple[Observation, Observation]]:
    """(current, candidate) pairs in the order they form: within a source, each observation pairs with the
    oldest waiting one of the other arm; an arm keeps at most ``window`` waiting (oldest dropped)."""
    waiting: dict = {}
    pairs = []
    for each in observations:
        queues = waiting.setdefault(each.source, {arm: deque(maxlen=window) for arm in ARMS})
        other = queues[ARMS[1 - ARMS.index(each.arm)]]
        if not other:
            queues[each.arm].append(each)
            continue
        partner = other.popleft()
        pairs.append((partner, each) if each.arm == "candidate" else (each, partner))
    return pairs


def decide(observations: Iterable[Observation], test: SequentialTest = SequentialTest()) -> Evidence:
    """The decision on the trial's observations so far, as a device reaches it looking after every new
    pair: nothing before ``min_conversations`` paired conversations; then each one-sided test stops at its
    first bound (a direction that accepted its H0 stays accepted), and the walk stops at the first
    decision."""
    observations = list(observations)
    unknown = [each.arm for each in observations if each.arm not in ARMS]
    if unknown:
        raise ValueError(f"arm {unknown[0]!r}: must be one of {ARMS}")
    kept, capped = admitted(first_verdicts(observations), test)
    walk = _Walk(test)
    pairs = pairs_in_time(kept, test.window)
    for current, candidate in pairs:
        if walk.step(current.up, candidate.up):
            break
    used = pairs[:walk.pairs]
    return Evidence(walk.decision, len(kept), len({(each.source, each.client) for each in kept}), capped,
                    walk.pairs, sum(a.up for a, _ in used), len(used), sum(b.up for _, b in used), len(used),
                    walk.candidate_wins, walk.current_wins, walk.better, walk.worse)


class _Walk:
    """The two one-sided SPRTs over discordant pairs."""

    def __init__(self, test: SequentialTest):
        self.test = test
        self.win = math.log(1 + 2 * test.delta)
        self.loss = math.log(1 - 2 * test.delta)
        self.better = self.worse = 0.0
        self.better_done = self.worse_done = False
        self.candidate_wins = self.current_wins = self.pairs = 0
        self.decision = "collecting"

    def step(self, current_up: bool, candidate_up: bool) -> bool:
        """Take one pair; True once decided."""
        self.pairs += 1
        if current_up != candidate_up:
            self.candidate_wins += int(candidate_up)
            self.current_wins += int(current_up)
            self.better += self.win if candidate_up else self.loss
            self.worse += self.win if current_up else self.loss
        if 2 * self.pairs < self.test.min_conversations:
            return False
        if not self.better_done and self.better >= self.test.upper:
            self.decision = "promote"
        elif not self.worse_done and self.worse >= self.test.upper:
            self.decision = "revert"
        else:
            self.better_done = self.better_done or self.better <= self.test.lower
            self.worse_done = self.worse_done or self.worse <= self.test.lower
            if self.better_done and self.worse_done:
                self.decision = "keep"
        return self.decision != "collecting"
