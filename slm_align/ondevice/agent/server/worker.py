"""The model thread: every generation runs on one worker thread, in arrival
order, behind a bounded queue.

A job whose client left is not worth the model's time: while a request waits,
:meth:`ModelWorker.run` watches its connection (the ASGI ``receive`` channel) and, when the client
disconnects, sets the job's ``cancel`` flag. A queued job that is cancelled never starts; a running
one stops at its next token (the job is handed the flag and checks it between tokens, see
:class:`slm_align.ondevice.agent.runtime.Agent`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional

from slm_align.ondevice.agent.runtime import Cancelled
from slm_align.ondevice.agent.server.errors import ApiError

Receive = Callable[[], Awaitable[dict]]
Job = Callable[[threading.Event], Iterator]
"""Makes a job's items on the model thread; it is given the job's cancel flag
to check between tokens."""


class Handoff:
    """Items a job makes on the model thread, on their way to the request
    waiting in the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        """Set when the request stopped waiting (its client left): the job does not start, or
        stops at its next token."""
        self.finished = False
        """The job ended (answered, failed or stopped); a later disconnect changes nothing."""

    def send(self, kind: str, value: Any = None) -> None:
        """Queue ``(kind, value)`` for the request: kind is item, error or end (called
        from the model thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop closed (shutdown): nobody is waiting
            pass


async def until_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request's body was read before:
    only the end can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ModelWorker:
    """``workers`` threads (one unless requests decode together on a batched engine) run the
    generations in arrival order; at most ``max_queue`` requests wait for them."""

    def __init__(self, max_queue: int, workers: int = 1):
        self.max_queue = max_queue
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slm-align-model")
        self._lock = threading.Lock()
        self.active = 0
        """Requests running or waiting."""
        self.abandoned = 0
        """Requests whose client left before the answer was complete (their job
        stops, or never starts)."""
        self.started = 0
        """Jobs the model thread started (a cancelled queued job is not started)."""

    def _admit(self) -> None:
        with self._lock:
            if self.active >= self.max_queue + self.workers:
                raise ApiError(503, f"the model is busy ({self.active} requests running or "
                               f"queued); retry shortly",
                               "server_overloaded", {"Retry-After": "1"})
            self.active += 1

    def _release(self, handoff: Handoff) -> None:
        with self._lock:
            self.active -= 1
            handoff.finished = True

    def _abandon(self, handoff: Handoff) -> None:
        """Cancel the job of a request nobody waits for any more (once; not after it ended)."""
        with self._lock:
            if handoff.finished or handoff.cancel.is_set():
                return
            handoff.cancel.set()
            self.abandoned += 1

    async def _watch(self, receive: Receive, handoff: Handoff) -> None:
        await until_disconnect(receive)
        self._abandon(handoff)

    async def run(self, job: Job, receive: Optional[Receive] = None) -> AsyncIterator:
        """The items of ``job(cancel)``, made on the model thread and handed over as they come.

        Raises ApiError 503 when the queue is full. With ``receive`` (the request's ASGI
        channel, its body already read) a client disconnecting at any time, before the first
        item or while queued, cancels the job; so does closing the iterator early. A cancelled
        job ends without further items.
        """
        self._admit()
        handoff = Handoff(asyncio.get_running_loop())
        watcher = asyncio.create_task(self._watch(receive, handoff)) if receive is not None else None
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
            if watcher is not None:
                watcher.cancel()
            if kind not in ("end", "error"):
                self._abandon(handoff)

    def _work(self, job: Job, handoff: Handoff) -> None:
        """On the model thread: run the job unless its request left while it waited;
        always release its place."""
        try:
            if not handoff.cancel.is_set():
                with self._lock:
                    self.started += 1
                self._produce(job(handoff.cancel), handoff)
        except Cancelled:
            pass
        except BaseException as exc:  # handed to the request, raised there
            handoff.send("error", exc)
        finally:
            self._release(handoff)
            handoff.send("end")

    @staticmethod
    def _produce(generator: Iterator, handoff: Handoff) -> None:
        try:
            for item in generator:
                if handoff.cancel.is_set():
                    return
                handoff.send("item", item)
        finally:
            close = getattr(generator, "close", None)
            if close:
                close()

    def close(self) -> None:
        """Stop taking jobs; queued ones are cancelled, the running one finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
