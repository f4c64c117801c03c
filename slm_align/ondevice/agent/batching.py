"""Many conversations at once: the runtime's loop advanced for every conversation that needs a token in one
forward of a batching :class:`Decoder` (continuous batching).

Each conversation runs the runtime's own loop (:class:`~slm_align.ondevice.agent.runtime.Agent`: template, parser,
stop rules, tools, observations) in its own worker thread, on a :class:`Lane`: a backend that owns one slot
of the decoder (a per-slot cache and sampler). A lane asking for its next token waits; the engine's thread
gathers the lanes waiting, runs one :meth:`Decoder.step` for all of them and hands each its token. Tools
run in the conversation's thread, so a conversation running its tools holds no one up, and a conversation
that finishes gives its slot to the next one waiting (:meth:`Engine.lane`). ``Agent.chat`` on a lane is
the one-conversation case.

Why threads and not a hand-written state machine over the loop: the loop stays one readable function
(:meth:`~slm_align.ondevice.agent.runtime.Agent.respond`) that the device runs too, and the decoder's forward (in
llama.cpp or PyTorch) releases the GIL, so the threads cost a little Python per token, not parallelism.

A conversation's tokens do not depend on its neighbours: a decoder keeps a cache and a seeded sampler per
slot (see :class:`Decoder`), so which lanes share a step changes nothing but the time taken.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence, TypeVar

import numpy as np

from slm_align.errors import UserError

GATHER_SECONDS = 0.002
"""How long the engine waits for lanes still running Python between tokens (detokenising, checking stop
strings) before it steps those already waiting; every active lane waiting ends the wait at once."""


@dataclass
class Draw:
    """One slot's next token, as its sampler drew it."""

    token: int
    logits: Optional[np.ndarray] = None
    """The (vocab,) fp32 logits the token was drawn from, when the slot's round asked for them."""
    logprob: Optional[float] = None
    """The sampler's own log-probability of ``token`` (decoders that sample exactly, for RL)."""


class Decoder(Protocol):
    """Per-slot caches and samplers over one model; one forward advances many slots.

    Besides the methods, a decoder carries the model's facts a :class:`Lane` passes on as a backend:
    ``kind``, ``n_ctx`` (positions per slot), ``vocab_size``, ``eos_ids``, ``chat_template``,
    ``chat_template_origin``, ``bos_token``, ``eos_token``, ``tokenize`` and ``detokenize`` (safe to call
    from any thread)."""

    slots: int
    """How many conversations it holds at once."""

    def crop(self, slot: int, keep: int) -> None:
        """Keep the first ``keep`` positions of ``slot``'s cache (0 empties it)."""

    def begin(self, slot: int, params, grammar: Optional[str], prompt: Sequence[int], logits: bool) -> None:
        """Set ``slot``'s sampler for a round that starts after ``prompt`` (seeded from ``params.seed``
        as the one-conversation backend seeds it); ``logits``: its draws carry their logits."""

    def step(self, feeds: dict[int, list[int]]) -> dict[int, Draw]:
        """Append each slot's ids to its cache, all in one forward (or as few as the engine's batch
        allows), and draw each slot's next token with its own sampler."""


class _Request:
    """A lane's ids waiting for the next step, and the answer when it has run."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.done = threading.Event()
        self.draw: Optional[Draw] = None
        self.error: Optional[BaseException] = None


class Engine:
    """Steps a :class:`Decoder` for the lanes waiting on it, from a thread of its own."""

    def __init__(self, decoder: Decoder, keep_caches: bool = False, prompts_first: bool = False):
        self.decoder = decoder
        self.keep_caches = keep_caches
        """A freed slot keeps its cache for the next lane on it, whose prompt then feeds only what it does
        not share with it (conversations that open alike: one system prompt and tools); a lane that ended
        in an error always empties its slot. Off: every freed slot is emptied."""
        self.prompts_first = prompts_first
        """A step with prompts (feeds of several ids) holds only them; the lanes waiting for one
        token go in the next step (with the new lanes' second tokens when those come within
        :data:`GATHER_SECONDS`). A new conversation's first token then waits for its own prompt
        only, not for a forward of every running conversation too (vLLM's scheduler puts
        prefills first likewise); the running ones wait one small step more. For a server's time
        to first token."""
        self._cached: dict[int, list[int]] = {}
        self.steps = 0
        """Forwards run (:meth:`Decoder.step` calls)."""
        self.stepped_rows = 0
        """Slots advanced, summed over the steps: ``stepped_rows / steps`` is the mean batch."""
        self._lock = threading.Condition()
        self._decoding = threading.Lock()
        """Held while the decoder runs: a slot's cache is cut or its sampler set only between steps."""
        self._waiting: dict[int, _Request] = {}
        self._active: set[int] = set()
        self._free = list(range(decoder.slots))[::-1]
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="slm-align-engine", daemon=True)
        self._thread.start()

    # lanes
    @contextmanager
    def lane(self) -> Iterator["Lane"]:
        """A free slot as a :class:`Lane`, waiting for one when all are taken (admission); the slot's cache
        is emptied (unless :attr:`keep_caches`) and the slot freed on the way out, whatever happened inside."""
        with self._lock:
            self._lock.wait_for(self._has_free_slot)
            if self._closed:
                raise RuntimeError("the engine is closed")
            slot = self._free.pop()
        lane = Lane(self, slot)
        lane.tokens = self._cached.pop(slot, [])
        failed = True
        try:
            yield lane
            failed = False
        finally:
            with self._decoding, self._lock:
                self._active.discard(slot)
                self._waiting.pop(slot, None)
                if self.keep_caches and not failed:
                    self._cached[slot] = lane.tokens
                else:
                    self.decoder.crop(slot, 0)
                self._free.append(slot)
                self._lock.notify_all()

    def _has_free_slot(self) -> bool:
        return bool(self._free) or self._closed

    def begin(self, slot: int, keep: int, params, grammar: Optional[str], prompt: Sequence[int],
              logits: bool) -> None:
        """``slot`` starts a round: its cache cut to ``keep`` ids, its sampler set; it now counts as active
        (the engine waits for it before stepping)."""
        with self._decoding, self._lock:
            self.decoder.crop(slot, keep)
            self.decoder.begin(slot, params, grammar, prompt, logits)
            self._active.add(slot)

    def end(self, slot: int) -> None:
        """``slot``'s round is over (it stopped, was cancelled or failed): the engine stops waiting for it."""
        with self._lock:
            self._active.discard(slot)
            self._waiting.pop(slot, None)
            self._lock.notify_all()

    def submit(self, slot: int, ids: list[int]) -> Draw:
        """Feed ``ids`` to ``slot`` in the next step; its next token."""
        request = _Request(ids)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting[slot] = request
            self._lock.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.draw

    # the engine's thread
    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                return
            self._step(batch)

    def _gather(self) -> Optional[dict[int, _Request]]:
        """The requests of the next step: every active lane's once all wait, else those waiting after
        :data:`GATHER_SECONDS`; None once closed."""
        with self._lock:
            self._lock.wait_for(self._something_waits)
            if self._closed:
                return None
            self._lock.wait_for(self._all_active_wait, timeout=GATHER_SECONDS)
            batch = dict(self._waiting)
            prompts = {slot: request for slot, request in batch.items() if len(request.ids) > 1}
            if self.prompts_first and prompts:
                batch = prompts
            for slot in batch:
                del self._waiting[slot]
            return batch

    def _something_waits(self) -> bool:
        return bool(self._waiting) or self._closed

    def _all_active_wait(self) -> bool:
        return self._active <= set(self._waiting) or self._closed

    def _step(self, batch: dict[int, _Request]) -> None:
        """One :meth:`Decoder.step` over ``batch``; a failure goes to every lane in it, never kills the
        engine."""
        try:
            with self._decoding:
                draws = self.decoder.step({slot: request.ids for slot, request in batch.items()})
        except BaseException as error:  # noqa: BLE001 - handed to the lanes that asked
            for request in batch.values():
                request.error = error
                request.done.set()
            return
        self.steps += 1
        self.stepped_rows += len(batch)
        for slot, request in batch.items():
            request.draw = draws[slot]
            request.done.set()

    def close(self) -> None:
        """Stop the engine's thread; lanes asking afterwards get an error."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Lane:
    """One conversation's slot of an :class:`Engine`, speaking the runtime's
    :class:`~slm_align.ondevice.agent.backend.Backend` protocol (what
    :class:`~slm_align.ondevice.agent.runtime.Agent` runs on). A round's prompt that starts with the ids already in the
    slot's cache feeds only the rest."""

    def __init__(self, engine: Engine, slot: int):
        self.engine = engine
        self.slot = slot
        self.decoder = engine.decoder
        self.tokens: list[int] = []
        """The ids the slot's cache holds."""
        self.want_logits = False
        """Draws carry their logits (set by a caller that reads :meth:`last_logits`, as logprobs do)."""
        self.drawn_logprobs: list[float] = []
        """The sampler's log-probability of each token the last :meth:`generate` drew (decoders that
        sample exactly)."""
        self.rounds: list[list[float]] = []
        """:attr:`drawn_logprobs` of every :meth:`generate` since it was last emptied (an episode's rounds)."""
        self._last: Optional[Draw] = None

    # the model's facts, as the decoder has them
    @property
    def kind(self) -> str:
        return self.decoder.kind

    @property
    def n_ctx(self) -> int:
        return self.decoder.n_ctx

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def eos_ids(self) -> set:
        return self.decoder.eos_ids

    @property
    def chat_template(self) -> Optional[str]:
        return self.decoder.chat_template

    @property
    def chat_template_origin(self) -> Optional[str]:
        return self.decoder.chat_template_origin

    @property
    def bos_token(self) -> Optional[str]:
        return self.decoder.bos_token

    @property
    def eos_token(self) -> Optional[str]:
        return self.decoder.eos_token

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return self.decoder.tokenize(text, add_special, special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.decoder.detokenize(ids)

    # decoding
    def reset(self) -> None:
        """Forget the cache (emptied at the next round)."""
        self.tokens = []

    def last_logits(self) -> np.ndarray:
        """The logits the token just yielded was drawn from."""
        if self._last is None or self._last.logits is None:
            raise RuntimeError("the decoder kept no logits; set want_logits before generating")
        return self._last.logits

    def generate(self, prompt: Sequence[int], params, grammar: Optional[str] = None) -> Iterator[int]:
        """Tokens after ``prompt`` until the caller stops asking; each is fed before the next is drawn."""
        prompt = list(prompt)
        if len(prompt) >= self.n_ctx:
            raise UserError(f"context window of {self.n_ctx} tokens exceeded; start a new conversation")
        keep = min(shared_prefix(self.tokens, prompt), len(prompt) - 1)  # the last id is fed again for its logits
        self.drawn_logprobs = []
        self.rounds.append(self.drawn_logprobs)
        self.engine.begin(self.slot, keep, params, grammar, prompt, self.want_logits)
        self.tokens = prompt[:keep]
        return self._draws(prompt[keep:])

    def _draws(self, feed: list[int]) -> Iterator[int]:
        try:
            while True:
                if len(self.tokens) + len(feed) > self.n_ctx:
                    raise UserError(f"context window of {self.n_ctx} tokens exceeded; start a new conversation")
                draw = self.engine.submit(self.slot, feed)
                self.tokens = self.tokens + feed
                self._last = draw
                if draw.logprob is not None:
                    self.drawn_logprobs.append(draw.logprob)
                yield draw.token
                feed = [draw.token]
        finally:
            self.engine.end(self.slot)


def shared_prefix(cached: Sequence[int], ids: Sequence[int]) -> int:
    """How many leading ids ``ids`` shares with ``cached``."""
    shared = 0
    for seen, new in zip(cached, ids):
        if seen != new:
            break
        shared += 1
    return shared


Item = TypeVar("Item")
Result = TypeVar("Result")


def run_many(engine: Engine, items: Sequence[Item], work: Callable[[Lane, Item], Result],
             on_done: Optional[Callable[[], None]] = None) -> list[Result]:
    """``work(lane, item)`` for every item, as many at once as the engine has slots, each on a lane of its
    own (a finished one's slot goes to the next item waiting); results in the order of ``items``. The first
    error raised by a ``work`` is raised here once all have ended. ``on_done`` is called after each item
    (a progress count)."""
    def one(item: Item) -> Result:
        with engine.lane() as lane:
            result = work(lane, item)
        if on_done is not None:
            on_done()
        return result

    with ThreadPoolExecutor(max_workers=engine.decoder.slots, thread_name_prefix="slm-align-lane") as pool:
        futures = [pool.submit(one, item) for item in items]
    return [future.result() for future in futures]
