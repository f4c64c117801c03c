"""Many conversations in one llama.cpp context: the :class:`~slm_align.ondevice.agent.batching.Decoder` that the
runtime's batching engine steps for GGUF artifacts (``evaluate-agent --batch``, ``serve``).

One context holds ``slots`` sequences (``n_seq_max``, ``slots x n_ctx`` positions, ``n_ctx`` those one
conversation has, as the one-conversation backend opened it), each in its own KV stream
(``kv_unified`` off: a token attends over its own sequence's cells only; a unified cache made every
token attend over all slots' cells, masked, and took 3x longer on the tiny fixture). The other
settings are the backend's context's (flash attention, RoPE, threads, ``n_batch``): the logits of a
slot are those the one-conversation backend computes (bit for bit on the test fixture).
A step is one ``llama_batch`` whose entries carry their slot as sequence id, logits asked only at
each slot's last id; feeds longer than ``n_batch`` (prompts) are decoded in several batches, a slot
drawing its token right after the batch that held its last id. Each slot has its own llama.cpp sampler
chain, built from :class:`~slm_align.ondevice.agent.settings.SamplingParams` as ``Llama.generate`` builds it for
:class:`~slm_align.ondevice.agent.llama_backend.LlamaCppBackend` (penalties over the round's last 64 ids, the
grammar, then greedy at temperature 0, else top-k, typical 1.0, top-p, min-p, temperature and
``dist(seed)``), and draws with ``llama_sampler_sample(chain, ctx, i)`` from its own row ``i`` of the
batch: a conversation's draws depend on its own ids and seed only.

The model, its tokenizer, chat template and LoRA adapters are those of a
:class:`~slm_align.ondevice.agent.llama_backend.LlamaCppBackend` already opened (and checked) by
:func:`~slm_align.ondevice.agent.loading.load_model`: the decoder adds a context on the same weights.
Why llama.cpp's low-level API and not ``Llama``: ``Llama`` keeps one sequence (its ``input_ids`` and
``eval``), and the server's many-sequence loop is C++ that llama-cpp-python does not expose.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent.batching import Draw, shared_prefix
from slm_align.ondevice.agent.call_rule import call_vocabulary, restrict, rule_acts
from slm_align.ondevice.agent.llama_prefix import DEFAULT_MAX_BYTES, MIN_SHARED, PrefixCache

Entry = tuple[int, int, int, bool]
"""(token, position, sequence, wants logits): one id of a llama.cpp batch."""


def decode_entries(lib, ctx, entries: Sequence[tuple[int, int, int, bool]]) -> None:
    """Decode (token, position, sequence, wants logits) entries in one llama.cpp batch; the logits asked
    for are then ``llama_get_logits_ith(ctx, i)``, ``i`` the entry's index. A failure is a UserError."""
    batch = lib.llama_batch_init(len(entries), 0, 1)
    try:
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = logits
        status = lib.llama_decode(ctx, batch)
    finally:
        lib.llama_batch_free(batch)
    if status != 0:
        raise UserError(f"llama.cpp could not decode a batch of {len(entries)} tokens (status {status}); "
                        "lower --batch or the context size")


def row_logits(lib, ctx, index: int, vocab: int) -> np.ndarray:
    """(vocab,) fp32 logits of entry ``index`` of the last decoded batch, copied."""
    return np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, index), shape=(vocab,)).copy()


def sampler_chain(llm, params, grammar: Optional[str]):
    """llama.cpp's sampler chain for one round, as ``Llama.generate`` builds it for these settings
    (``Llama._init_sampler``, llama-cpp-python 0.3.x: no logits processor, no mirostat)."""
    from llama_cpp import LlamaGrammar
    from llama_cpp._internals import LlamaSampler

    chain = LlamaSampler()
    chain.add_penalties(n_vocab=llm.n_vocab(), penalty_last_n=llm.last_n_tokens_size,
                        penalty_repeat=params.repeat_penalty, penalty_freq=params.frequency_penalty,
                        penalty_present=params.presence_penalty)
    if grammar:
        chain.add_grammar(llm._model, LlamaGrammar.from_string(grammar, verbose=False))
    if params.temperature == 0.0:
        chain.add_greedy()
        return chain
    chain.add_top_k(params.top_k)
    chain.add_typical(1.0, 1)
    chain.add_top_p(params.top_p, 1)
    chain.add_min_p(params.min_p, 1)
    chain.add_temp(params.temperature)
    chain.add_dist(params.seed)
    return chain


GRAMMAR_IN_CHAIN = 1
"""Where :func:`sampler_chain` puts the grammar: after the penalties."""


def greedy_if_grammar_allows(lib, chain, logits: np.ndarray) -> Optional[int]:
    """The most likely token when ``chain``'s grammar accepts it, accepted into the chain; None when the
    grammar refuses it (then the whole chain must run).

    At temperature 0 without penalties this is the token the chain draws: the likeliest token the grammar
    accepts is the likeliest token whenever the grammar accepts that one. It checks one candidate instead of
    the whole vocabulary (about 50 ms a draw for a tool-call grammar over SmolLM2's 49k tokens), as llama.cpp's
    common sampler tries the unconstrained draw before it constrains every candidate; llama-cpp-python's
    ``Llama.generate`` does not, hence this."""
    token = int(np.argmax(logits))  # the first of equal maxima, as llama.cpp's greedy sampler picks
    candidate = (lib.llama_token_data * 1)(lib.llama_token_data(token, float(logits[token]), 0.0))
    single = lib.llama_token_data_array(candidate, 1, -1, False)
    lib.llama_sampler_apply(lib.llama_sampler_chain_get(chain.sampler, GRAMMAR_IN_CHAIN), ctypes.byref(single))
    if not np.isfinite(candidate[0].logit):
        return None
    lib.llama_sampler_accept(chain.sampler, token)
    return token


class LlamaBatchDecoder:
    """``slots`` conversations over the model of ``backend`` (a
    :class:`~slm_align.ondevice.agent.llama_backend.LlamaCppBackend`), each with ``backend.n_ctx`` positions."""

    kind = "gguf"

    def __init__(self, backend, slots: int, prefix_bytes: int = DEFAULT_MAX_BYTES):
        import llama_cpp

        self.lib = llama_cpp
        most = llama_cpp.llama_max_parallel_sequences()
        if not 1 <= slots <= most:
            raise UserError(f"--batch must be between 1 and {most} (llama.cpp's sequences per context), got {slots}")
        self.backend = backend
        self.llm = backend.llm
        self.slots = slots
        self.n_ctx = backend.n_ctx
        self.vocab_size = backend.vocab_size
        self.ctx = self._context()
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.positions = [0] * slots
        """Ids in each slot's cache."""
        self.ids: list[list[int]] = [[] for _ in range(slots)]
        """The ids in each slot's cache."""
        self.prefixes = PrefixCache(llama_cpp, self.ctx, prefix_bytes)
        """Prompt prefixes' K/V, copied into slots instead of prefilled (``prefix_bytes`` 0:
        off)."""
        self.prefilled = 0
        """Ids decoded as prompts (feeds of more than one id), after any copied in."""
        self._chains: dict[int, object] = {}
        self._keep_logits: dict[int, bool] = {}
        self._greedy_grammar: dict[int, bool] = {}
        """Slots drawing greedily under a grammar, without penalties (see :func:`greedy_if_grammar_allows`)."""
        self._call_rules: dict[int, tuple[int, Optional[float]]] = {}
        """Each slot's round: where its reply starts in :attr:`ids`, and its call threshold (see
        :mod:`~slm_align.ondevice.agent.call_rule`)."""
        self.grammar_checks = [0, 0]
        """Draws the grammar shortcut settled, and draws it handed to the whole chain."""
        self.apply_adapters()

    def _context(self):
        """A context with the backend's settings (flash attention, RoPE scaling, threads, batch: the
        same numbers as the one-conversation context) but ``slots`` sequences, a KV stream each."""
        lib = self.lib
        source = self.llm.context_params
        params = type(source).from_buffer_copy(source)
        params.n_ctx = self.slots * self.n_ctx
        params.n_seq_max = self.slots
        params.kv_unified = False
        ctx = lib.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise UserError(f"llama.cpp could not make a context for {self.slots} conversations of {self.n_ctx} "
                            "positions; lower --batch")
        self.n_batch = params.n_batch
        return ctx

    def apply_adapters(self) -> None:
        """The backend's LoRA adapters now, in order at scale 1, on this context too (call between steps)."""
        handles = self.backend.adapter_handles()
        array = (self.lib.llama_adapter_lora_p_ctypes * max(1, len(handles)))(*handles)
        scales = (ctypes.c_float * max(1, len(handles)))(*([1.0] * len(handles)))
        if self.lib.llama_set_adapters_lora(self.ctx, array, len(handles), scales):
            raise UserError("llama.cpp cannot apply the adapters to the batched context; export them again")
        for slot in range(self.slots):
            self.crop(slot, 0)  # computed with the old weights
        self.prefixes.clear()

    # the model's facts, as the backend has them (its chat template may have been replaced)
    @property
    def eos_ids(self) -> set:
        return self.backend.eos_ids

    @property
    def chat_template(self) -> Optional[str]:
        return self.backend.chat_template

    @property
    def chat_template_origin(self) -> Optional[str]:
        return self.backend.chat_template_origin

    @property
    def bos_token(self) -> Optional[str]:
        return self.backend.bos_token

    @property
    def eos_token(self) -> Optional[str]:
        return self.backend.eos_token

    @property
    def adapters(self) -> list[dict]:
        return self.backend.adapters

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special, special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.backend.detokenize(ids)

    # the Decoder protocol
    def crop(self, slot: int, keep: int) -> None:
        """Keep ``slot``'s first ``keep`` positions (``llama_memory_seq_rm`` of the rest)."""
        if keep < self.positions[slot]:
            self.lib.llama_memory_seq_rm(self.memory, slot, keep, -1)
            self.positions[slot] = keep
            del self.ids[slot][keep:]

    def begin(self, slot: int, params, grammar: Optional[str], prompt: Sequence[int], logits: bool) -> None:
        """``slot``'s sampler chain for the round (see :func:`sampler_chain`)."""
        old = self._chains.pop(slot, None)
        if old is not None:
            old.close()
        self._chains[slot] = sampler_chain(self.llm, params, grammar)
        self._keep_logits[slot] = logits
        self._greedy_grammar[slot] = bool(grammar) and params.temperature == 0.0 and not params.penalized
        self._call_rules[slot] = (len(prompt), params.call_threshold)

    def step(self, feeds: dict[int, list[int]]) -> dict[int, Draw]:
        """Each slot's ids appended in batches of ``n_batch`` entries (the backend's), each slot
        drawing from its last id's logits right after the batch that held it. A prompt's leading ids
        already in a snapshot (or shared with another prompt of this step) are copied in, not
        decoded (:meth:`_reuse`)."""
        for slot, ids in feeds.items():
            if self.positions[slot] + len(ids) > self.n_ctx:
                raise UserError(f"context window of {self.n_ctx} tokens exceeded; start a new conversation")
        feeds, unmatched = self._reuse({slot: list(ids) for slot, ids in feeds.items()})
        draws = self._decode(self._entries(feeds))
        for slot in unmatched:
            self.prefixes.save(slot, self.ids[slot])
        return draws

    def _entries(self, feeds: dict[int, list[int]], logits: bool = True) -> list[Entry]:
        """(token, position, slot, wants logits) of every fed id, the slots' positions and ids
        advanced; logits at each slot's last id (none when ``logits`` is off).

        In slot order, not the order the lanes asked in: with a KV stream per sequence llama.cpp
        splits a batch into micro-batches by ``split_equal(sequential=true)``, which takes a
        sequence into the current micro-batch only when its id is the previous one's + 1
        (``src/llama-batch.cpp``, "accept only increasing sequence ids"). Each micro-batch is a
        forward over all the weights: slots 3, 0, 1, 2 in arrival order were three forwards, in
        slot order one (a step of 8 SmolLM2 rows: 110-116 ms against 70-72, docs/benchmarks.md).
        Slots missing from a step (a conversation prompting or running its tools) still split it."""
        entries = []
        for slot, ids in sorted(feeds.items()):
            start = self.positions[slot]
            last = len(ids) - 1
            entries += [(token, start + i, slot, logits and i == last)
                        for i, token in enumerate(ids)]
            self.positions[slot] += len(ids)
            self.ids[slot] += ids
            if len(ids) > 1 or not logits:  # a prompt, or a shared prefix decoded ahead of it
                self.prefilled += len(ids)
        return entries

    def _decode(self, entries: list[Entry]) -> dict[int, Draw]:
        draws = {}
        for first in range(0, len(entries), self.n_batch):
            chunk = entries[first:first + self.n_batch]
            decode_entries(self.lib, self.ctx, chunk)
            for index, (_, _, slot, last) in enumerate(chunk):
                if last:
                    draws[slot] = self._draw(slot, index)
        return draws

    # prompt-prefix reuse
    def _reuse(self, feeds: dict[int, list[int]]) -> tuple[dict[int, list[int]], list[int]]:
        """``feeds`` less the leading ids copied in from a snapshot or shared within this step, and
        the prompting slots no snapshot served (snapshotted once they are decoded)."""
        unmatched = []
        for slot in [slot for slot, ids in feeds.items() if len(ids) > 1]:
            full = self.ids[slot] + feeds[slot]
            snapshot, count = self.prefixes.best(full)
            if count < MIN_SHARED:
                unmatched.append(slot)
            elif min(count, len(full) - 1) - self.positions[slot] >= MIN_SHARED:
                feeds[slot] = self._copy_in(slot, snapshot, min(count, len(full) - 1), full)
        prompting = [slot for slot in unmatched if len(feeds[slot]) > 1]
        shared_now = self._share_in_step(feeds, prompting)
        return feeds, [slot for slot in unmatched if slot not in shared_now]

    def _copy_in(self, slot: int, snapshot, keep: int, full: list[int]) -> list[int]:
        """``slot`` holds the snapshot's first ``keep`` ids; what of ``full`` it must still be
        fed."""
        before = self.positions[slot]
        self.crop(slot, 0)
        if not self.prefixes.restore(snapshot, slot):
            self.lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
            return full
        self.positions[slot] = len(snapshot.ids)
        self.ids[slot] = list(snapshot.ids)
        self.crop(slot, keep)
        self.prefixes.copied_ids += keep - before
        return full[keep:]

    def _share_in_step(self, feeds: dict[int, list[int]], prompting: list[int]) -> set[int]:
        """Prompts of this step that open alike: the first one's shared ids decoded once (no
        logits), snapshotted and copied into the others. The slots served that way."""
        served = set()
        while len(prompting) > 1:
            lead, others = prompting[0], prompting[1:]
            lead_ids = self.ids[lead] + feeds[lead]
            group = {}
            for slot in others:
                full = self.ids[slot] + feeds[slot]
                count = min(shared_prefix(lead_ids, full), len(full) - 1, len(lead_ids) - 1)
                if count - self.positions[slot] >= MIN_SHARED:
                    group[slot] = count
            prompting = [slot for slot in others if slot not in group]
            if not group:
                continue
            common = min(group.values())
            if not self.prefixes.fits(common):
                return served
            if common > self.positions[lead]:
                head = lead_ids[self.positions[lead]:common]
                self._decode(self._entries({lead: head}, logits=False))
            feeds[lead] = lead_ids[self.positions[lead]:]
            snapshot = self.prefixes.save(lead, self.ids[lead])
            if snapshot is None:
                return served
            served.add(lead)
            for slot in group:
                feeds[slot] = self._copy_in(slot, snapshot, common, self.ids[slot] + feeds[slot])
                served.add(slot)
        return served

    def _draw(self, slot: int, index: int) -> Draw:
        self._apply_call_rule(slot, index)
        keep = self._keep_logits[slot]
        logits = row_logits(self.lib, self.ctx, index, self.vocab_size) if keep or self._greedy_grammar[slot] else None
        if self._greedy_grammar[slot]:
            token = greedy_if_grammar_allows(self.lib, self._chains[slot], logits)
            self.grammar_checks[token is None] += 1
            if token is not None:
                return Draw(token, logits if keep else None)
        token = self.lib.llama_sampler_sample(self._chains[slot].sampler, self.ctx, index)
        return Draw(int(token), logits if keep else None)

    def _apply_call_rule(self, slot: int, index: int) -> None:
        """The call rule on entry ``index``'s logits, in llama.cpp's own buffer, so the slot's chain (and the
        logits kept) see what it banned."""
        start, threshold = self._call_rules[slot]
        if threshold is None:
            return
        vocabulary = call_vocabulary(self.backend)
        if rule_acts(threshold, vocabulary, self.ids[slot][start:]):
            live = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.vocab_size,))
            restrict(live, threshold, vocabulary)

    def close(self) -> None:
        self.prefixes.clear()
        for chain in self._chains.values():
            chain.close()
        self._chains.clear()
        if self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx = None
