"""The numpy sampler used by the onnxruntime backend (llama.cpp samples natively); its parameters,
:class:`SamplingParams`, live with their typed bounds in :mod:`slm_align.ondevice.agent.settings`.

The numpy sampler follows llama.cpp's chain (as llama-cpp-python builds it), so a setting means the
same on both backends: repetition penalties over the last :data:`PENALTY_WINDOW` generated tokens,
then top-k, top-p and min-p on the untempered probabilities, then temperature, then a draw.
Temperature 0 takes the most likely token after the penalties, as llama.cpp's greedy sampler does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from slm_align.ondevice.agent.settings import PENALTY_WINDOW, SamplingParams

__all__ = ["PENALTY_WINDOW", "SamplingParams", "apply_penalties", "candidates", "sample_token"]


def apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """``logits`` with llama.cpp's repetition penalties for the tokens among
    the last generated ones."""
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
