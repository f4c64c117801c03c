"""Choosing the call rule's threshold: the opening score is the largest P(open) on the greedy walk over blank
tokens, and the threshold chosen best separates the rows that call from those that decline (balanced)."""

from __future__ import annotations

import numpy as np
import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.call_calibration import (
    GRID,
    OpeningScore,
    best_plateau_middle,
    choose_threshold,
    decision_rates,
    opening_score,
)
from slm_align.ondevice.agent.call_rule import CallVocabulary

PIECES = ["<tool_call>", "<", " ", "\n", "Sorry", "I", "</s>"]
VOCABULARY = CallVocabulary.of(PIECES)
OPEN, LT, SPACE, NEWLINE, SORRY, PRONOUN, END = range(len(PIECES))


def logits_of(weights: dict) -> np.ndarray:
    """Logits over PIECES with these probabilities (the rest shared evenly by the non-openers not named)."""
    probabilities = np.full(len(PIECES), 0.0)
    for token, weight in weights.items():
        probabilities[token] = weight
    rest = [token for token in range(len(PIECES)) if token not in weights and not VOCABULARY.openers[token]]
    probabilities[rest] = (1 - sum(weights.values())) / len(rest)
    with np.errstate(divide="ignore"):  # an opener left out gets probability 0: logit -inf
        return np.log(probabilities).astype(np.float32)


class Scripted:
    """A backend whose next-token logits are scripted by position after the prompt; records what it is fed."""

    def __init__(self, script: list[np.ndarray]):
        self.script = script
        self.fed: list[list[int]] = []

    def reset(self) -> None:
        self.fed = []

    def feed(self, ids) -> np.ndarray:
        self.fed.append(list(ids))
        return self.script[len(self.fed) - 1].copy()


def test_the_score_is_the_largest_opening_probability_on_the_blank_walk():
    # position 0: P(open) 0.3 and the likeliest non-opener is a space; position 1: P(open) 0.7 (split over two
    # openers), then text: greedy under the rule at t <= 0.7 walks the space and opens at position 1
    backend = Scripted([logits_of({OPEN: 0.2, LT: 0.1, SPACE: 0.6}),
                        logits_of({OPEN: 0.5, LT: 0.2, SORRY: 0.25}),
                        logits_of({SORRY: 0.9})])
    score = opening_score(backend, [9, 9], VOCABULARY, stops={END})
    assert score == pytest.approx(0.7, abs=1e-5)
    assert backend.fed == [[9, 9], [SPACE]]  # the prompt, then the likeliest non-opener (the space) only


def test_the_walk_ends_at_the_first_text_or_end_of_turn():
    # text is likeliest among non-openers at position 0: later positions can never be reached under the rule
    backend = Scripted([logits_of({OPEN: 0.3, SORRY: 0.5}), logits_of({OPEN: 0.99})])
    assert opening_score(backend, [1], VOCABULARY, stops={END}) == pytest.approx(0.3, abs=1e-5)
    assert backend.fed == [[1]]
    ended = Scripted([logits_of({OPEN: 0.3, END: 0.6}), logits_of({OPEN: 0.99})])
    assert opening_score(ended, [1], VOCABULARY, stops={END}) == pytest.approx(0.3, abs=1e-5)


def test_the_walk_stops_after_max_blanks():
    blanks = [logits_of({OPEN: 0.1 + 0.01 * i, NEWLINE: 0.7}) for i in range(20)]
    backend = Scripted(blanks)
    score = opening_score(backend, [1], VOCABULARY, stops={END})
    assert len(backend.fed) == 8  # the prompt and 7 blanks: 8 positions decided
    assert score == pytest.approx(0.17, abs=1e-5)


def scores(calls: list[float], declines: list[float]) -> list[OpeningScore]:
    return ([OpeningScore(score, True, "simple") for score in calls]
            + [OpeningScore(score, False, "irrelevance") for score in declines])


def test_decision_rates_count_a_score_equal_to_the_threshold_as_a_call():
    rows = scores([0.6, 0.9], [0.6, 0.2])
    rates = decision_rates(rows, 0.6)
    assert rates["call_rate"] == 1.0  # 0.6 >= 0.6 calls, as the rule does
    assert rates["decline_rate"] == 0.5
    assert rates["balanced"] == 0.75


def test_the_chosen_threshold_is_the_middle_of_the_widest_best_stretch():
    # (0.40, 0.60]: every call row calls, 2 of 3 declines decline; (0.65, 0.70]: 2 of 3 calls, all declines:
    # both 0.833 balanced; the first stretch is 20 grid points wide, the second 5: its middle, 0.50, is chosen
    rows = scores([0.9, 0.7, 0.6], [0.2, 0.4, 0.65])
    chosen = choose_threshold(rows)
    assert chosen["threshold"] == pytest.approx(0.50)
    assert chosen["balanced"] == pytest.approx(5 / 6)
    assert (chosen["rows"], chosen["call_rows"]) == (6, 3)
    assert [row["threshold"] for row in chosen["table"]] == pytest.approx(list(GRID))


def test_balanced_accuracy_weighs_each_kind_by_its_own_count():
    # (0.2, 0.3]: 12/12 calls and 1/2 declines, 13 of 14 rows right; (0.5, 0.9]: 10/12 and 2/2, 12 of 14.
    # Plain accuracy would choose the first; balanced (0.75 against 0.917) the second
    rows = scores([0.9] * 10 + [0.3] * 2, [0.5, 0.2])
    chosen = choose_threshold(rows)
    assert 0.5 < chosen["threshold"] <= 0.9
    assert chosen["balanced"] == pytest.approx((10 / 12 + 1) / 2)


def test_best_plateau_middle_takes_the_longest_run_and_the_first_of_equal_ones():
    assert best_plateau_middle(np.array([0, 1, 1, 0, 1, 1, 1, 0])) == 5
    assert best_plateau_middle(np.array([1, 1, 0, 1, 1])) == 0
    assert best_plateau_middle(np.array([0, 0, 3])) == 2


def test_rows_of_one_kind_are_refused():
    with pytest.raises(UserError, match="rows that call and rows that do not"):
        choose_threshold(scores([0.2, 0.9], []))
