"""Which answer of a pair a model prefers, in the runtime (agent/preference_probe.py)."""

from __future__ import annotations

import numpy as np
import pytest

from slm_align.ondevice.agent.preference_probe import completion_logprob, log_softmax

VOCAB = 5
EOS = 4


class TableBackend:
    """A model whose next-token logits depend only on the current token: row ``id`` of a table.
    Text is its characters' digits ("12" -> [1, 2]); the BOS id is 0."""

    eos_token = "4"

    def __init__(self, table: np.ndarray):
        self.table = table
        self.fed = None
        self.resets = 0

    def tokenize(self, text, add_special=True, special=True):
        return ([0] if add_special else []) + [int(char) for char in text]

    def reset(self):
        self.resets += 1

    def feed_all(self, ids):
        self.fed = list(ids)
        return self.table[ids]


def test_log_softmax_rows_are_normalised_and_stable():
    """exp sums to 1 per row, float64, and huge logits do not overflow (mutation: max not subtracted)."""
    logits = np.array([[1000.0, 1000.0, 0.0], [1.0, 2.0, 3.0]], dtype=np.float32)
    out = log_softmax(logits)
    assert out.dtype == np.float64
    np.testing.assert_allclose(np.exp(out).sum(axis=1), [1.0, 1.0])
    np.testing.assert_allclose(out[0, :2], [np.log(0.5)] * 2)
    np.testing.assert_allclose(out[1], np.array([1.0, 2.0, 3.0]) - np.log(np.exp([1.0, 2.0, 3.0]).sum()))


def test_completion_logprob_scores_completion_and_eos_from_the_prompts_last_position():
    """Sum of log p over the completion's tokens and EOS, each predicted by the previous position
    (mutation: off-by-one start, EOS left out, prompt tokens scored)."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(VOCAB, VOCAB))
    backend = TableBackend(table)
    logp = log_softmax(table)
    # prompt "1" -> [0, 1] (BOS added); completion "23" -> [2, 3] + EOS 4
    expected = logp[1, 2] + logp[2, 3] + logp[3, EOS]
    assert completion_logprob(backend, "1", "23") == pytest.approx(expected)
    assert backend.fed == [0, 1, 2, 3, EOS]
    assert backend.resets == 1


def test_without_eos_token_only_the_completion_is_scored():
    """A backend without an EOS text scores the completion alone (mutation: EOS tokenised from None)."""
    table = np.log(np.full((VOCAB, VOCAB), 1.0 / VOCAB))
    backend = TableBackend(table)
    backend.eos_token = None
    assert completion_logprob(backend, "1", "23") == pytest.approx(2 * np.log(1.0 / VOCAB))


def test_the_likelier_answer_scores_higher():
    """A model that predicts 2 after 1 prefers completion '2' over '3' (mutation: sign or index swapped)."""
    table = np.zeros((VOCAB, VOCAB))
    table[1, 2] = 5.0
    backend = TableBackend(table)
    assert completion_logprob(backend, "1", "2") > completion_logprob(backend, "1", "3")
