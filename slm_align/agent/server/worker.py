"""The model thread: every generation runs on one worker thread, in arrival order, behind a bounded queue."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator

from slm_align.agent.server.errors import ApiError


class Handoff:
    """Items a job makes on the model thread, on their way to the request waiting in the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stop = threading.Event()
        """Set when the request stopped waiting (its client left): the job ends at its next item."""

    def send(self, kind: str, value: Any = None) -> None:
        """Queue ``(kind, value)`` for the request: kind is item, error or end (called from the model thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop closed (shutdown): nobody is waiting
            pass


class ModelWorker:
    """One thread runs every generation in arrival order; at most ``max_queue`` requests wait for it."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slm-align-model")
        self._lock = threading.Lock()
        self.active = 0
        """Requests running or waiting."""
        self.abandoned = 0
        """Requests whose client left before the answer was complete (their job stops at its next item)."""

    def _admit(self) -> None:
        with self._lock:
            if self.active > self.max_queue:
                raise ApiError(503, f"the model is busy ({self.active} requests running or queued); retry shortly",
                               "server_overloaded", {"Retry-After": "1"})
            self.active += 1

    def _release(self) -> None:
        with self._lock:
            self.active -= 1

    def _abandon(self, handoff: Handoff) -> None:
        handoff.stop.set()
        with self._lock:
            self.abandoned += 1

    async def run(self, job: Callable[[], Iterator]) -> AsyncIterator:
        """The items of ``job()``, made on the model thread and handed over as they come.

        Raises ApiError 503 when the queue is full. Closing the iterator early (a client that left) stops the job
        at its next item.
        """
        self._admit()
        handoff = Handoff(asyncio.get_running_loop())
        self._executor.submit(self._work, job, handoff)
        kind = None
        try:
            while kind != "end":
                message = await handoff.queue.get()
                kind = message[0]
                if kind == "error":
                    raise message[1]
                if kind == "item":
                    yield message[1]
        finally:
            if kind not in ("end", "error"):
                self._abandon(handoff)

    def _work(self, job: Callable[[], Iterator], handoff: Handoff) -> None:
        """On the model thread: run the job unless its request left while it waited; always release its place."""
        try:
            if not handoff.stop.is_set():
                self._produce(job(), handoff)
        except BaseException as exc:  # handed to the request, raised there
            handoff.send("error", exc)
        finally:
            self._release()
            handoff.send("end")

    @staticmethod
    def _produce(generator: Iterator, handoff: Handoff) -> None:
        try:
            for item in generator:
                handoff.send("item", item)
                if handoff.stop.is_set():
                    return
        finally:
            close = getattr(generator, "close", None)
            if close:
                close()

    def close(self) -> None:
        """Stop taking jobs; queued ones are cancelled, the running one finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
