"""Log-probabilities of generated tokens, in OpenAI's ``logprobs.content`` shape.

Each entry is the model's own distribution at that step (a log-softmax of the raw logits, before
penalties, temperature or a grammar), as vLLM reports by default; ``top_logprobs`` lists the
most likely tokens there.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs``."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of ``logits`` (float64)."""
    shifted = logits.astype(np.float64) - float(np.max(logits))
    return shifted - np.log(np.sum(np.exp(shifted)))


def _entry(token: int, logprob: float, detokenize: Callable[[Sequence[int]], str]) -> dict:
    text = detokenize([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def token_logprobs(logits: np.ndarray, token: int, top: int, detokenize: Callable[[Sequence[int]], str]) -> dict:
    """``{"token", "logprob", "bytes", "top_logprobs"}`` for ``token`` drawn from ``logits``, with
    the ``top`` likeliest tokens at that step."""
    logprobs = log_softmax(logits)
    likeliest = np.argsort(logprobs, kind="stable")[::-1][:top]
    entry = _entry(token, float(logprobs[token]), detokenize)
    entry["top_logprobs"] = [_entry(int(other), float(logprobs[other]), detokenize) for other in likeliest]
    return entry
