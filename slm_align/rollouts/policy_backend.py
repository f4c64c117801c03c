"""The policy being trained as a backend of the agent runtime, so that an RL episode runs the runtime's
own chat loop (template, parser, stop rules, tools) with the PyTorch model underneath.

It samples exactly from the policy: at the sampling temperature (and ``top_p``) of
:func:`~slm_align.modeling.generation.draw_tokens`, no top-k, min-p or penalties (settings it cannot follow
are refused), so the log-probabilities the update recomputes are those of the distribution the tokens
were drawn from. Its KV cache is kept across calls: a prompt that starts with the ids already in the
cache (the next tool round's prompt starts with the last round's prompt and the ids sampled in it)
feeds only the new ones.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
from transformers import DynamicCache

from slm_align.errors import UserError
from slm_align.modeling.accelerator import device_of
from slm_align.modeling.generation import draw_tokens
from slm_align.ondevice.agent.batching import shared_prefix
from slm_align.ondevice.templates.chat import default_chat_template


class PolicyFacts:
    """What the runtime reads of the policy as a backend (its kind, context, vocabulary, end ids, template and
    special tokens), for :class:`PolicyBackend` and the batching
    :class:`~slm_align.rollouts.policy_decoder.PolicyDecoder` alike."""

    kind = "torch"

    def __init__(self, model, tokenizer, chat_template: Optional[str] = None, n_ctx: Optional[int] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device_of(model)
        config = getattr(model, "config", None)
        self.n_ctx = n_ctx or getattr(config, "max_position_embeddings", None) or 4096
        self.vocab_size = len(tokenizer)
        self.eos_ids = {tokenizer.eos_token_id}
        self.chat_template = policy_template(tokenizer, chat_template)
        self.chat_template_origin = "policy"
        self.bos_token = tokenizer.bos_token
        self.eos_token = tokenizer.eos_token


class PolicyBackend(PolicyFacts):
    """One conversation's worth of cache over ``model`` (a causal LM, the LoRA folded in for
    sampling), speaking the runtime's :class:`~slm_align.ondevice.agent.backend.Backend` protocol."""

    def __init__(self, model, tokenizer, chat_template: Optional[str] = None, n_ctx: Optional[int] = None):
        super().__init__(model, tokenizer, chat_template, n_ctx)
        self.tokens: list[int] = []
        """The ids the cache holds."""
        self.drawn_logprobs: list[float] = []
        """The sampler's own log-probability of each token the last :meth:`generate` drew."""
        self.rounds: list[list[float]] = []
        """:attr:`drawn_logprobs` of every :meth:`generate` since it was last emptied (an episode's rounds)."""
        self._cache = None
        self._logits: Optional[torch.Tensor] = None

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """The tokenizer's ids of ``text``; without ``special`` special-token text stays characters."""
        return self.tokenizer(text, add_special_tokens=add_special, split_special_tokens=not special)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def reset(self) -> None:
        """Empty the cache."""
        self.tokens = []
        self._cache = None
        self._logits = None

    def last_logits(self):
        """The logits the token just drawn came from (fp32 numpy)."""
        return self._logits.float().cpu().numpy()

    def generate(self, prompt: Sequence[int], params, grammar: Optional[str] = None) -> Iterator[int]:
        """Tokens drawn from the policy after ``prompt`` until the caller stops asking; each is fed
        before the next is drawn. The draw is seeded by ``params.seed`` and the prompt's length, so
        every round of an episode draws its own numbers and a rerun draws the same."""
        if grammar is not None:
            raise UserError("the policy samples without a grammar; train with grammar-free tool rounds")
        check_exact(params)
        prompt = list(prompt)
        generator = torch.Generator(device=self.device).manual_seed(round_seed(params.seed, len(prompt)))
        self.drawn_logprobs = []
        self.rounds.append(self.drawn_logprobs)
        self._start(prompt)
        while True:
            token, logprob = draw_tokens(self._logits.float(), params.temperature, params.top_p,
                                         generator=generator)
            self.drawn_logprobs.append(float(logprob[0]))
            yield int(token[0])
            self._append([int(token[0])])

    def _start(self, prompt: list[int]) -> None:
        """Make the cache hold ``prompt``: keep what it shares with it (the last id is fed again,
        for its logits), feed the rest."""
        keep = min(shared_prefix(self.tokens, prompt), len(prompt) - 1)
        if keep == 0:
            self.reset()
        else:
            self._cache.crop(keep)
            self.tokens = self.tokens[:keep]
        self._append(prompt[keep:])

    @torch.no_grad()
    def _append(self, ids: list[int]) -> None:
        """Feed ``ids`` after the cache; keep the last position's logits. The cache is a plain
        ``DynamicCache`` from the start: the model's own would keep a sliding-window layer's last
        ``sliding_window - 1`` positions only (Gemma 3) and refuse :meth:`_start`'s crop once a
        conversation is longer (the window is the attention mask's, as in a full forward)."""
        inputs = torch.tensor([ids], device=self.device)
        cache = self._cache if self._cache is not None else DynamicCache()
        output = self.model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._cache = output.past_key_values
        self._logits = output.logits[:, -1]
        self.tokens = self.tokens + ids


def policy_template(tokenizer, chosen: Optional[str] = None) -> str:
    """The template episodes render with: the one chosen, else the tokenizer's own, else ChatML's."""
    return chosen or tokenizer.chat_template or default_chat_template(tokenizer)


def round_seed(seed: int, prompt_length: int) -> int:
    """The seed of one round's draws: an episode's seed with its prompt's length folded in, so that its
    rounds draw different numbers (the same numbers would tie a round's tokens to the last one's)."""
    return seed * 1_000_003 + prompt_length


def check_exact(params) -> None:
    """Refuse sampling settings the policy backend cannot follow exactly (its draws must be the
    policy's distribution at the temperature, for the importance ratios to hold)."""
    inexact = []
    if params.top_k:
        inexact.append(f"top_k {params.top_k}")
    if params.min_p:
        inexact.append(f"min_p {params.min_p}")
    if getattr(params, "penalized", False):
        inexact.append("repetition penalties")
    if getattr(params, "call_threshold", None) is not None:
        inexact.append(f"the call rule (call_threshold {params.call_threshold})")
    if inexact:
        raise UserError(f"RL episodes sample the policy exactly, at the temperature only; drop {', '.join(inexact)}")
