"""The call rule: a reply calls a tool exactly when the model's probability of opening a call reaches a
threshold (``--call-threshold``), instead of when the single likeliest first token happens to open one.

Why: a tuned small model spreads a decline over many first tokens ("I", "Sorry", "There", ...) while
every call opens with ``<tool_call>``. Greedy decoding then calls even where the model puts most of its
probability on not calling: SmolLM2-135M after SFT and GRPO gave P(call) below one half on 65% of the
requests no offered function fits, and called on every one of them (docs/benchmarks.md, "Function
calling on real models"). The rule decides by mass: while the reply holds only whitespace, the
probability of the tokens that open a call,

    p = sum over t in openers of softmax(logits)[t]        logits: (vocab,) float32, the model's own,

is compared with the threshold. At ``p >= threshold`` every other token is banned at that position, below
it every opener is (their logits set to -inf, in place); the sampler then draws as it would from what is
left (greedy: the likeliest; sampled: the rest of its chain). The first non-blank token ends the rule for
the reply: under the runtime's tool grammar a reply that starts as text cannot call later.

No library offers this: llama.cpp's samplers and logit biases act on single tokens, not on the mass of a
set decided per position. Stdlib and numpy only: this module runs on phones and boards.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

CALL_OPENING = "<tool_call>"
"""What every call the runtime parses and its grammar allows starts with
(:func:`~slm_align.ondevice.tools.parse.call_text`)."""

_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class CallVocabulary:
    """Which token ids open a call and which are blank, for one tokenizer."""

    openers: np.ndarray
    """(vocab,) bool: the token's text, leading whitespace aside, is a non-empty start of :data:`CALL_OPENING`
    or starts with it (``" <"`` opens ``" <tool_call>"``, which the runtime reads as a call too)."""
    blank: np.ndarray
    """(vocab,) bool: the token's text is whitespace only (drawing it leaves the reply undecided)."""

    @classmethod
    def of(cls, pieces: Sequence[str]) -> "CallVocabulary":
        """The vocabulary of a tokenizer whose id ``i`` reads ``pieces[i]``."""
        stripped = [piece.lstrip() for piece in pieces]
        openers = np.array([bool(text) and (CALL_OPENING.startswith(text) or text.startswith(CALL_OPENING))
                            for text in stripped])
        blank = np.array([bool(piece) and not piece.strip() for piece in pieces])
        return cls(openers=openers, blank=blank)


def call_vocabulary(backend) -> CallVocabulary:
    """``backend``'s :class:`CallVocabulary`, read once from its tokenizer (``detokenize`` of each id) and
    kept while the backend lives."""
    known = _VOCABULARIES.get(backend)
    if known is None:
        pieces = [backend.detokenize([token]) for token in range(backend.vocab_size)]
        known = _VOCABULARIES[backend] = CallVocabulary.of(pieces)
    return known


def opening_probability(logits: np.ndarray, openers: np.ndarray) -> float:
    """P(the next token opens a call): softmax of ``logits`` (vocab,) summed over ``openers`` (vocab,) bool."""
    scaled = logits.astype(np.float64)
    weights = np.exp(scaled - scaled.max())
    return float(weights[openers].sum() / weights.sum())


def rule_acts(threshold: Optional[float], vocabulary: Optional[CallVocabulary], generated: Sequence[int]) -> bool:
    """The rule is set and the reply so far (``generated``, its ids) is blank: this position decides."""
    if threshold is None or vocabulary is None:
        return False
    blank = vocabulary.blank
    return all(token < len(blank) and blank[token] for token in generated)


def opener_mask(vocabulary: CallVocabulary, size: int) -> np.ndarray:
    """(size,) bool: the openers among a model's ``size`` logits (its padded rows beyond the tokenizer's ids
    open nothing)."""
    openers = np.zeros(size, dtype=bool)
    known = min(size, len(vocabulary.openers))
    openers[:known] = vocabulary.openers[:known]
    return openers


def restrict(logits: np.ndarray, threshold: float, vocabulary: CallVocabulary) -> bool:
    """Ban, in place in ``logits`` (vocab,), what the rule rules out at this position: every opener when
    P(open) < ``threshold``, every other token when it is reached (never all: a tokenizer without openers
    never calls). Returns whether it chose a call."""
    openers = opener_mask(vocabulary, len(logits))
    calls = bool(openers.any()) and opening_probability(logits, openers) >= threshold
    logits[~openers if calls else openers] = -np.inf
    return calls
