"""The policy being trained as a batching :class:`~slm_align.ondevice.agent.batching.Decoder`: many episodes' next
tokens in one PyTorch forward, each episode sampled exactly as :class:`~slm_align.rollouts.policy_backend.PolicyBackend`
samples it alone.

Each slot keeps its own key/value cache (per layer a (kv_heads, capacity, head_dim) buffer that doubles as it
fills). A step runs the slots fed one id (decoding) together: their caches are left-padded to the longest into one
``DynamicCache`` (B, kv_heads, W, head_dim), with an attention mask that is 0 on the padding and explicit
``position_ids`` (each row's own length), so a row attends to its own ids only, at its own positions (keys are
cached after RoPE, so where a key sits in the padded tensor changes nothing). A slot fed several ids (a round's
prompt, or the ids the runtime inserted after a tool call) runs alone first, on its own cache, as the
one-conversation backend runs it. Why hand-gathered caches and not transformers' ``generate``: its batches start
and stop together and sample with one generator; episodes come and go (continuous batching) and each draws from
its own seeded generator.

Sampling is :func:`~slm_align.modeling.generation.draw_tokens` per row at the temperature (and ``top_p``), with a
``torch.Generator`` per slot seeded ``round_seed(params.seed, len(prompt))`` as the one-conversation backend seeds
it, and the log-probability of each draw kept (:attr:`Draw.logprob`): an episode's tokens do not depend on which
episodes share its step, up to the last bits of a batched matmul (tests/rl/test_policy_decoder.py).
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from slm_align.errors import UserError
from slm_align.modeling.generation import draw_tokens
from slm_align.ondevice.agent.batching import Draw
from slm_align.rollouts.policy_backend import PolicyFacts, check_exact, round_seed


class SlotCache:
    """One slot's keys and values: per layer a (kv_heads, capacity, head_dim) buffer, ``length`` of it used."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.ids: list[int] = []
        """The ids whose keys and values it holds."""

    @property
    def length(self) -> int:
        return len(self.ids)

    def crop(self, keep: int) -> None:
        self.ids = self.ids[:keep]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_heads, length, head_dim) keys and values of one layer (views)."""
        return self.keys[index][:, :self.length], self.values[index][:, :self.length]

    def append(self, ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append ``ids``' per layer (kv_heads, n, head_dim) keys and values after ``length``."""
        count = len(ids)
        if not self.keys:
            self.keys = [k.new_empty(k.shape[0], 0, k.shape[2]) for k in keys]
            self.values = [v.new_empty(v.shape[0], 0, v.shape[2]) for v in values]
        if self.length + count > self.keys[0].shape[1]:
            self._grow(self.length + count)
        end = self.length + count
        for index, (k, v) in enumerate(zip(keys, values)):
            self.keys[index][:, self.length:end] = k
            self.values[index][:, self.length:end] = v
        self.ids = self.ids + list(ids)

    def copy_from(self, other: "SlotCache", end: int) -> None:
        """Append ``other``'s positions from this cache's length up to ``end`` (the ids before agree)."""
        start = self.length
        pairs = [other.layer(index) for index in range(len(other.keys))]
        self.append(other.ids[start:end], [k[:, start:end] for k, _ in pairs], [v[:, start:end] for _, v in pairs])

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys[0].shape[1], 64)
        self.keys = [_widened(k, self.length, capacity) for k in self.keys]
        self.values = [_widened(v, self.length, capacity) for v in self.values]


def _widened(buffer: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    wider = buffer.new_empty(buffer.shape[0], capacity, buffer.shape[2])
    wider[:, :used] = buffer[:, :used]
    return wider


class _Sampler:
    """A slot's round: its sampling settings, its seeded generator, whether draws keep their logits."""

    def __init__(self, params, generator: torch.Generator, logits: bool):
        self.params = params
        self.generator = generator
        self.logits = logits


class PolicyDecoder(PolicyFacts):
    """``slots`` episodes' caches over ``model`` (a causal LM, the LoRA folded in for sampling), stepped
    together by an :class:`~slm_align.ondevice.agent.batching.Engine`; a
    :class:`~slm_align.ondevice.agent.batching.Lane` of it speaks the runtime's backend protocol as
    :class:`~slm_align.rollouts.policy_backend.PolicyBackend` does."""

    def __init__(self, model, tokenizer, slots: int, chat_template: Optional[str] = None,
                 n_ctx: Optional[int] = None):
        super().__init__(model, tokenizer, chat_template, n_ctx)
        self.slots = slots
        self.caches = [SlotCache() for _ in range(slots)]
        self.samplers: dict[int, _Sampler] = {}
        self.forwards = 0
        """Model forwards run (a step's decode rows share one; each prefill is one)."""
        self.shared_prefills = 0
        """Prefills copied from a slot that computed the same ids (:meth:`_prefill`)."""
        self._tokenizing = threading.Lock()
        self._prefills: dict[tuple[int, tuple[int, ...]], tuple[int, torch.Tensor]] = {}
        """(cached length, ids after the prefill) -> (the slot that computed it, its last logits)."""
        self._batch: Optional[tuple[tuple[int, ...], DynamicCache, torch.Tensor]] = None
        """The last decode forward's slots, its cache and attention mask, reused while those slots decode on."""

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """The tokenizer's ids of ``text``; without ``special`` special-token text stays characters. One thread
        at a time: a fast tokenizer refuses to be borrowed by two ("Already borrowed")."""
        with self._tokenizing:
            return self.tokenizer(text, add_special_tokens=add_special,
                                  split_special_tokens=not special)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        with self._tokenizing:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def crop(self, slot: int, keep: int) -> None:
        if keep >= self.caches[slot].length:
            return
        self.caches[slot].crop(keep)
        self._forget(slot, keep)

    def _forget(self, slot: int, keep: int = 0) -> None:
        """The slot's cache beyond ``keep`` changes: the prefills it computed past there and the batch it is
        in no longer stand."""
        stale = [key for key, (source, _) in self._prefills.items() if source == slot and len(key[1]) > keep]
        for key in stale:
            del self._prefills[key]
        if self._batch is not None and slot in self._batch[0]:
            self._batch = None

    def begin(self, slot: int, params, grammar: Optional[str], prompt: Sequence[int], logits: bool) -> None:
        """The slot's round: exact sampling only (as the one-conversation backend), its generator seeded by
        the episode's seed and the prompt's length."""
        if grammar is not None:
            raise UserError("the policy samples without a grammar; train with grammar-free tool rounds")
        check_exact(params)
        generator = torch.Generator(device=self.device).manual_seed(round_seed(params.seed, len(prompt)))
        self.samplers[slot] = _Sampler(params, generator, logits)

    @torch.no_grad()
    def step(self, feeds: dict[int, list[int]]) -> dict[int, Draw]:
        """Prefill the slots fed several ids (or starting empty) one by one, decode the rest in one forward;
        each slot's draw from its own sampler."""
        logits: dict[int, torch.Tensor] = {}
        decoding = sorted(slot for slot, ids in feeds.items() if len(ids) == 1 and self.caches[slot].length > 0)
        for slot, ids in feeds.items():
            if slot not in decoding:
                logits[slot] = self._prefill(slot, list(ids))
        if decoding:
            rows = self._forward(decoding, [feeds[slot] for slot in decoding])
            logits.update(zip(decoding, rows))
        return {slot: self._draw(slot, logits[slot]) for slot in feeds}

    def _prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` to the slot alone; or, when another slot computed the same ids from the same cached
        length (a group's episodes share their prompt), copy its keys, values and logits: the numbers this
        forward would give, bit for bit, without running it."""
        self._forget(slot, self.caches[slot].length)
        cache = self.caches[slot]
        key = (cache.length, tuple(cache.ids + ids))
        source, logits = self._prefills.get(key, (None, None))
        if source is not None and self.caches[source].ids[:len(key[1])] == list(key[1]):
            cache.copy_from(self.caches[source], len(key[1]))
            self.shared_prefills += 1
            return logits
        logits = self._forward([slot], [ids])[0]
        self._prefills[key] = (slot, logits)
        return logits

    def _draw(self, slot: int, logits: torch.Tensor) -> Draw:
        """One token from the slot's sampler over its (V,) logits, as PolicyBackend draws it."""
        sampler = self.samplers[slot]
        row = logits.float().unsqueeze(0)
        token, logprob = draw_tokens(row, sampler.params.temperature, sampler.params.top_p,
                                     generator=sampler.generator)
        kept = row[0].cpu().numpy() if sampler.logits else None
        return Draw(int(token[0]), kept, float(logprob[0]))

    def _forward(self, slots: list[int], feeds: list[list[int]]) -> list[torch.Tensor]:
        """One forward of ``feeds`` (one per slot: all of one length) after the slots' caches, left-padded to
        the longest; each slot's cache gets its new keys and values. The last position's logits per row."""
        lengths = [self.caches[slot].length for slot in slots]
        width = max(lengths)
        count = len(feeds[0])
        cache, attention = self._batched(slots, lengths, width, count)
        positions = torch.tensor([[length + j for j in range(count)] for length in lengths], device=self.device)
        inputs = torch.tensor(feeds, device=self.device)
        output = self.model(input_ids=inputs, attention_mask=attention, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.forwards += 1
        self._keep(slots, feeds, output.past_key_values)
        self._batch = (tuple(slots), output.past_key_values, attention) if count == 1 else None
        return list(output.logits[:, -1])

    def _batched(self, slots: list[int], lengths: list[int], width: int,
                 count: int) -> tuple[DynamicCache, torch.Tensor]:
        """The slots' caches as one left-padded cache and its (B, width + count) attention mask. When the
        slots decode again after the last decode forward, or some of them (the others stopped), its cache and
        mask one column on (their rows); else gathered anew."""
        if count == 1 and self._batch is not None and set(slots) <= set(self._batch[0]):
            batched, cache, attention = self._batch
            if tuple(slots) != batched:
                rows = torch.tensor([batched.index(slot) for slot in slots], device=self.device)
                cache.batch_select_indices(rows)
                attention = attention[rows]
            ones = torch.ones((len(slots), 1), dtype=attention.dtype, device=self.device)
            return cache, torch.cat([attention, ones], dim=1)
        attention = torch.zeros((len(slots), width + count), dtype=torch.long, device=self.device)
        for row, length in enumerate(lengths):
            attention[row, width - length:] = 1
        return self._gathered(slots, lengths, width), attention

    def _gathered(self, slots: list[int], lengths: list[int], width: int) -> DynamicCache:
        """The slots' caches as one (B, kv_heads, width, head_dim) DynamicCache, each row left-padded. Empty
        caches too are given: the model's own would keep a sliding-window layer's last ``sliding_window - 1``
        positions only (Gemma 3), and :meth:`_keep` reads every fed position's keys back (the window is the
        attention mask's, as in a full forward)."""
        if width == 0:
            return DynamicCache()
        layers = []
        for index in range(len(self.caches[slots[0]].keys)):
            pairs = [self.caches[slot].layer(index) for slot in slots]
            keys = torch.stack([_left_padded(k, width) for k, _ in pairs])
            values = torch.stack([_left_padded(v, width) for _, v in pairs])
            layers.append((keys, values))
        return DynamicCache(layers)

    def _keep(self, slots: list[int], feeds: list[list[int]], cache) -> None:
        """Append the forward's new keys and values (the positions of ``feeds``, its last) to each slot's cache."""
        count = len(feeds[0])
        keys = [layer.keys[:, :, -count:] for layer in cache.layers]
        values = [layer.values[:, :, -count:] for layer in cache.layers]
        for row, slot in enumerate(slots):
            self.caches[slot].append(feeds[row], [k[row] for k in keys], [v[row] for v in values])


def _left_padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """(H, L, D) padded with zeros on the left to (H, width, D)."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, missing, 0))
