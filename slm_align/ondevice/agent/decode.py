"""Decoding loops over a backend's ``feed``: greedy, and our sampler with the cache of a
prompt's known prefix kept."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from slm_align.ondevice.agent.backend import Backend
from slm_align.ondevice.agent.call_rule import call_vocabulary, restrict, rule_acts
from slm_align.ondevice.agent.sampling import sample_token


def greedy(backend: Backend, prompt: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Greedy continuation of ``prompt`` from an empty cache."""
    backend.reset()
    logits = backend.feed(list(prompt))
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        token = int(np.argmax(logits))
        tokens.append(token)
        if stop_at_eos and token in backend.eos_ids or len(tokens) == max_new_tokens:
            break
        logits = backend.feed([token])
    return tokens


def numpy_generate(backend, prompt: Sequence[int], params) -> Iterator[int]:
    """Our sampling loop over ``feed``: the cache of the prompt's prefix seen before
    is kept, the rest fed; ``params.call_threshold`` applies the call rule
    (:mod:`~slm_align.ondevice.agent.call_rule`)."""
    prompt = list(prompt)
    shared = 0
    for seen, new in zip(backend.tokens, prompt[:-1]):  # the last prompt token is fed again for its logits
        if seen != new:
            break
        shared += 1
    backend.rewind(shared)
    rng = np.random.default_rng(params.seed)
    vocabulary = call_vocabulary(backend) if params.call_threshold is not None else None
    logits = backend.feed(prompt[shared:])
    generated: list[int] = []
    while True:
        if rule_acts(params.call_threshold, vocabulary, generated):
            logits = np.array(logits)  # the backend's own logits stay the model's
            restrict(logits, params.call_threshold, vocabulary)
        token = sample_token(logits, params, rng, generated)
        generated.append(token)
        yield token
        logits = backend.feed([token])
