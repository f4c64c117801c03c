"""Agent episodes sampled by the runtime's own llama.cpp backend: the device's engine, tokenizer and
sampler chain run every round, with the current LoRA swapped in as an adapter GGUF.

:class:`ExactLlamaBackend` is :class:`~slm_align.ondevice.agent.llama_backend.LlamaCppBackend` (the backend
``slm-align chat`` and ``serve`` run) drawing at the run's temperature only, keeping the
log-probability of each token it drew: log softmax(logits / T)[token], over the logits llama.cpp drew
it from. With top-k 0, top-p 1, min-p 0 and no penalty, llama.cpp's chain (temperature, then a draw
from the softmax) samples exactly that distribution, so these are the sampler's log-probabilities that
:mod:`slm_align.rl.sampler_correction` weighs against the trainer's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.rollouts.episodes import SEED_SPAN
from slm_align.rollouts.policy_backend import check_exact, round_seed

EPISODE_CONTEXT = 4096
"""Positions of the episode context (the model's own limit when smaller): the KV cache a phone would
give one conversation."""


def tempered_logprob(logits: np.ndarray, token: int, temperature: float) -> float:
    """log softmax(logits / T)[token] for (V,) logits, in float64 (one row: cheap, and exact enough
    that the mismatch it feeds measures the engines, not this sum)."""
    scaled = logits.astype(np.float64) / temperature
    top = scaled.max()
    return float(scaled[token] - top - np.log(np.exp(scaled - top).sum()))


class ExactLlamaBackend(LlamaCppBackend):
    """The runtime's llama.cpp backend sampling exactly at the temperature and keeping each draw's
    log-probability (:attr:`drawn_logprobs` per round, :attr:`rounds` per episode), as
    :class:`~slm_align.rollouts.policy_backend.PolicyBackend` does for PyTorch."""

    def __init__(self, base_gguf: Path, chat_template: str, threads: int, n_ctx: int):
        super().__init__(base_gguf, threads=threads, n_ctx=n_ctx)
        self.chat_template = chat_template
        self.chat_template_origin = "policy"
        self.drawn_logprobs: list[float] = []
        self.rounds: list[list[float]] = []

    def generate(self, prompt: Sequence[int], params, grammar: Optional[str] = None) -> Iterator[int]:
        """llama.cpp's chain at the temperature only, seeded per round as the PyTorch backend is."""
        if grammar is not None:
            raise UserError("the policy samples without a grammar; train with grammar-free tool rounds")
        check_exact(params)
        if params.top_p < 1.0:
            raise UserError(f"RL episodes on llama.cpp sample at the temperature only; drop top_p {params.top_p}")
        self.drawn_logprobs = []
        self.rounds.append(self.drawn_logprobs)
        seeded = replace(params, seed=round_seed(params.seed, len(prompt)) % SEED_SPAN)
        for token in super().generate(prompt, seeded):
            self.drawn_logprobs.append(tempered_logprob(self.last_logits(), token, params.temperature))
            yield token

    def swap_adapters(self, adapters: Sequence[Path]) -> None:
        """Apply ``adapters`` in place of the last ones and free the handles no longer applied (the
        policy's adapter is rewritten every iteration; keeping each would grow by its size)."""
        self.set_adapters(adapters)
        self.release_unused()


class ExactLlamaDecoder:
    """A batching llama.cpp :class:`~slm_align.ondevice.agent.batching.Decoder` (many episodes in one context, each slot
    its own sampler chain) made to sample as :class:`ExactLlamaBackend` does: the temperature only, each round's
    chain seeded ``round_seed(params.seed, len(prompt))``, and every draw's log-probability kept
    (:attr:`~slm_align.ondevice.agent.batching.Draw.logprob`, :func:`tempered_logprob` of the logits it was drawn from).
    The model's facts are the wrapped decoder's."""

    def __init__(self, decoder):
        self.decoder = decoder
        self._temperatures: dict[int, float] = {}
        self._want_logits: dict[int, bool] = {}

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)  # slots, kind, n_ctx, tokenize, ...: the wrapped decoder's

    def crop(self, slot: int, keep: int) -> None:
        self.decoder.crop(slot, keep)

    def begin(self, slot: int, params, grammar: Optional[str], prompt: Sequence[int], logits: bool) -> None:
        """Refuse what is not exact (a grammar, top-k, min-p, penalties, top-p); the slot's chain seeded per
        round and asked for its logits (the log-probability needs them)."""
        if grammar is not None:
            raise UserError("the policy samples without a grammar; train with grammar-free tool rounds")
        check_exact(params)
        if params.top_p < 1.0:
            raise UserError(f"RL episodes on llama.cpp sample at the temperature only; drop top_p {params.top_p}")
        self._temperatures[slot] = params.temperature
        self._want_logits[slot] = logits
        seeded = replace(params, seed=round_seed(params.seed, len(prompt)) % SEED_SPAN)
        self.decoder.begin(slot, seeded, None, prompt, True)

    def step(self, feeds: dict[int, list[int]]) -> dict:
        draws = self.decoder.step(feeds)
        for slot, draw in draws.items():
            draw.logprob = tempered_logprob(draw.logits, draw.token, self._temperatures[slot])
            if not self._want_logits[slot]:
                draw.logits = None
        return draws
