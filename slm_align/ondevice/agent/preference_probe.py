"""Which answer of a preference pair an exported model prefers, measured in the
runtime itself (no torch).

The loop's success measure: after a DPO or KTO round on device feedback, the new artifact should
give the chosen answer of held-out pairs a higher log-probability than the rejected one more often
than the old artifact did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import numpy as np

from slm_align.ondevice.agent.backend import Backend
from slm_align.ondevice.agent.open_artifact import open_backend


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of (T, V) logits, in float64: x - max - log sum exp(x - max)."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def completion_logprob(backend: Backend, prompt: str, completion: str) -> float:
    """log p(completion | prompt) summed over the completion's tokens and
    EOS (as training scores it).

    The prompt is tokenised with BOS and its template markers parsed (it was rendered by the chat
    template); the logits at position t predict token t + 1, so the completion's tokens are scored
    from the prompt's last position.
    """
    prompt_ids = backend.tokenize(prompt, add_special=True, special=True)
    completion_ids = backend.tokenize(completion, add_special=False, special=True)
    if backend.eos_token:
        completion_ids = completion_ids + backend.tokenize(backend.eos_token, add_special=False, special=True)
    backend.reset()
    logprobs = log_softmax(backend.feed_all(prompt_ids + completion_ids))
    start = len(prompt_ids) - 1
    positions = np.arange(start, start + len(completion_ids))
    return float(logprobs[positions, completion_ids].sum())


def preferred_count(artifact: Union[str, Path], pairs: Sequence) -> int:
    """How many ``pairs`` (each with ``prompt``, ``chosen``, ``rejected`` text) the artifact gives
    the chosen answer a higher log-probability than the rejected one."""
    backend = open_backend(Path(artifact), all_logits=True)
    wins = 0
    for pair in pairs:
        chosen = completion_logprob(backend, pair.prompt, pair.chosen)
        rejected = completion_logprob(backend, pair.prompt, pair.rejected)
        wins += chosen > rejected
    return wins
