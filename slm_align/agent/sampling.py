"""Sampling parameters and the numpy sampler used by the onnxruntime backend (llama.cpp samples natively)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    """How the next token is chosen. ``temperature`` 0 is greedy and identical on both backends."""

    temperature: float = 0.7
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 0.95
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this."""
    top_k: int = 40
    """Keep only the k most likely tokens (0: all)."""
    max_tokens: int = 256
    """Most tokens one reply may have."""
    stop: list = field(default_factory=list)
    """Strings that end the reply (not included in it)."""
    seed: int = 0
    """Seed of the sampler, so a reply can be reproduced."""

    def to_dict(self) -> dict:
        return asdict(self)


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from ``logits`` under ``params`` (top-k, then top-p, then temperature)."""
    if params.temperature <= 0:
        return int(np.argmax(logits))
    candidates = np.argsort(logits)[::-1]
    if params.top_k > 0:
        candidates = candidates[: params.top_k]
    scaled = logits[candidates].astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
    probs = probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(keep, p=probs)])
