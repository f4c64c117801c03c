"""Prompt-prefix reuse for :class:`~slm_align.ondevice.agent.llama_batch.LlamaBatchDecoder`:
a prompt prefix's KV computed once, then copied into the slots whose prompts open with it,
instead of prefilled again (conversations that open alike: one system prompt, one tool list).

The copies are llama.cpp's sequence states: ``llama_state_seq_get_data`` writes one sequence's cells
(positions and K/V bytes) to host memory and ``llama_state_seq_set_data`` reads them into another
sequence, whichever KV stream it has. Why not ``llama_memory_seq_cp``: between the per-sequence
streams the decoder uses (``kv_unified`` off) llama.cpp copies a whole stream only (all ``n_ctx``
cells, with an assert on partial ranges), where a state copies the cells in use. A restored slot is
then cut back to the shared prefix (``llama_memory_seq_rm``). The bytes are those the prefill wrote,
so the ids after them see the same keys and values as in a slot that prefilled them itself.

This is llama.cpp server's prompt cache (``cache_prompt`` and its host-memory prompt cache) for the
batched context: a few snapshots, least recently used dropped first, at most ``max_bytes`` in all.
A snapshot holds a previous prompt's K/V (and its ids) in this process's memory, never in a reply.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Optional, Sequence

from slm_align.ondevice.agent.batching import shared_prefix

MIN_SHARED = 8
"""Ids a snapshot must save a slot before it is copied in (a copy costs about as much as a few ids'
prefill)."""

DEFAULT_MAX_BYTES = 64 * 2**20
"""Host memory the snapshots may take (SmolLM2-135M: about 23 KB of K/V per id, 2,900 ids)."""


@dataclass
class Snapshot:
    """One sequence's cells, as llama.cpp wrote them, and the ids they hold."""

    ids: tuple[int, ...]
    state: ctypes.Array = field(repr=False)


class PrefixCache:
    """Snapshots of prompts' K/V in host memory, most recently used last."""

    def __init__(self, lib, ctx, max_bytes: int = DEFAULT_MAX_BYTES):
        self.lib = lib
        self.ctx = ctx
        self.max_bytes = max_bytes
        self.snapshots: list[Snapshot] = []
        self.copied_ids = 0
        """Ids copied into slots instead of prefilled."""

    @property
    def bytes(self) -> int:
        return sum(len(snapshot.state) for snapshot in self.snapshots)

    def best(self, ids: Sequence[int]) -> tuple[Optional[Snapshot], int]:
        """The snapshot sharing the most leading ids with ``ids``, and how many."""
        found, most = None, 0
        for snapshot in self.snapshots:
            count = shared_prefix(snapshot.ids, ids)
            if count > most:
                found, most = snapshot, count
        return found, most

    def fits(self, count: int) -> bool:
        """Whether a snapshot of ``count`` ids may fit (by the bytes an id took so far; any while
        none was taken)."""
        if self.max_bytes <= 0:
            return False
        taken = sum(len(snapshot.ids) for snapshot in self.snapshots)
        return not taken or count * self.bytes / taken <= self.max_bytes

    def save(self, slot: int, ids: Sequence[int]) -> Optional[Snapshot]:
        """Snapshot ``slot`` (which holds exactly ``ids``); None when it would not fit. Snapshots
        whose ids open the new one's are dropped (it serves every prompt they served)."""
        if self.max_bytes <= 0:
            return None
        size = self.lib.llama_state_seq_get_size(self.ctx, slot)
        if size > self.max_bytes:
            return None
        state = (ctypes.c_uint8 * size)()
        if self.lib.llama_state_seq_get_data(self.ctx, state, size, slot) != size:
            return None
        snapshot = Snapshot(tuple(ids), state)
        self.snapshots = [old for old in self.snapshots if shared_prefix(old.ids, ids) < len(old.ids)]
        self.snapshots.append(snapshot)
        while self.bytes > self.max_bytes:
            self.snapshots.pop(0)
        return snapshot

    def restore(self, snapshot: Snapshot, slot: int) -> bool:
        """Replace ``slot``'s cells by the snapshot's (all of its ids); False when llama.cpp
        refused."""
        size = len(snapshot.state)
        if self.lib.llama_state_seq_set_data(self.ctx, snapshot.state, size, slot) == 0:
            return False
        self.snapshots.remove(snapshot)
        self.snapshots.append(snapshot)  # most recently used
        return True

    def clear(self) -> None:
        self.snapshots.clear()
