"""Sampling parameters and the numpy sampler used by the onnxruntime backend (llama.cpp samples natively).

The numpy sampler follows llama.cpp's chain (as llama-cpp-python builds it), so a setting means the same on both
backends: repetition penalties over the last :data:`PENALTY_WINDOW` generated tokens, then top-k, top-p and min-p on
the untempered probabilities, then temperature, then a draw. Temperature 0 takes the most likely token after the
penalties, as llama.cpp's greedy sampler does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

PENALTY_WINDOW = 64
"""Generated tokens the repetition penalties look back over (llama-cpp-python's ``last_n_tokens_size``)."""


@dataclass
class SamplingParams:
    """How the next token is chosen. ``temperature`` 0 is greedy and identical on both backends."""

    temperature: float = 0.7
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 0.95
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this."""
    top_k: int = 40
    """Keep only the k most likely tokens (0: all)."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one's probability (0: off)."""
    repeat_penalty: float = 1.0
    """Divide the (positive) logits of recently generated tokens by this (1: off; 1.1-1.3 stops tiny models
    looping)."""
    frequency_penalty: float = 0.0
    """Subtract this times a token's count among recent tokens from its logit (OpenAI's frequency_penalty)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token among recent tokens (OpenAI's presence_penalty)."""
    max_tokens: int = 256
    """Most tokens one reply may have."""
    stop: list = field(default_factory=list)
    """Strings that end the reply (not included in it)."""
    seed: int = 0
    """Seed of the sampler, so a reply can be reproduced."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def penalized(self) -> bool:
        """Any repetition penalty is on."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """``logits`` with llama.cpp's repetition penalties for the tokens among the last generated ones."""
    window = list(history)[-PENALTY_WINDOW:]
    if not params.penalized or not window:
        return logits
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    penalized = np.array(logits, dtype=np.float32)
    values = penalized[ids]
    values = np.where(values <= 0, values * np.float32(params.repeat_penalty),
                      values / np.float32(params.repeat_penalty))
    values -= counts.astype(np.float32) * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty)
    penalized[ids] = values
    return penalized


def _softmax(logits: np.ndarray) -> np.ndarray:
    scaled = logits.astype(np.float64)
    probs = np.exp(scaled - scaled.max())
    return probs / probs.sum()


def candidates(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The token ids still in the draw after top-k, top-p and min-p, most likely first."""
    ranked = np.argsort(logits, kind="stable")[::-1]
    if params.top_k > 0:
        ranked = ranked[: params.top_k]
    probs = _softmax(logits[ranked])
    keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
    if params.min_p > 0:
        keep = min(keep, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    return ranked[:keep]


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                 history: Sequence[int] = ()) -> int:
    """One token from ``logits`` under ``params``; ``history`` holds the tokens generated so far."""
    logits = apply_penalties(logits, params, history)
    if params.temperature <= 0:
        return int(np.argmax(logits))
    kept = candidates(logits, params)
    probs = _softmax(logits[kept] / params.temperature)
    return int(kept[rng.choice(len(kept), p=probs)])
