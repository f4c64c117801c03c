"""The model thread (server/worker.py): order, errors, the bounded queue, cancellation by disconnect or
by closing the stream early. Jobs block on events, never on sleeps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from slm_align.ondevice.agent.server.errors import ApiError
from slm_align.ondevice.agent.server.worker import ModelWorker

WAIT = 30.0
"""Seconds a test waits for a thread before failing (a hang guard, never a measured time)."""


def items_of(*values):
    def job(cancel):
        yield from values
    return job


def blocked_until(gate: threading.Event, *values):
    """A job that waits for ``gate`` before making its items."""
    def job(cancel):
        assert gate.wait(WAIT)
        yield from values
    return job


async def collect(stream) -> list:
    return [item async for item in stream]


async def settle():
    """Let every ready task take its first step (admission happens there)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_items_arrive_in_order_and_the_place_is_released():
    """Mutation: items reordered or dropped, or active not decremented."""
    async def scenario():
        worker = ModelWorker(max_queue=2)
        got = await collect(worker.run(items_of(1, 2, 3)))
        worker.close()
        return got, worker
    got, worker = asyncio.run(scenario())
    assert got == [1, 2, 3]
    assert (worker.active, worker.started, worker.abandoned) == (0, 1, 0)


def test_a_jobs_exception_is_raised_in_the_request():
    """Mutation: the error swallowed (the stream would just end)."""
    def failing(cancel):
        yield 1
        raise ValueError("broken model")

    async def scenario():
        worker = ModelWorker(max_queue=1)
        got = []
        with pytest.raises(ValueError, match="broken model"):
            async for item in worker.run(failing):
                got.append(item)
        worker.close()
        return got, worker.active
    assert asyncio.run(scenario()) == ([1], 0)


def test_full_queue_is_a_503_with_retry_after():
    """One running + max_queue waiting are admitted, the next is refused (mutation: the bound off by one,
    or requests queued without limit)."""
    async def scenario():
        gate = threading.Event()
        worker = ModelWorker(max_queue=1)
        first = asyncio.ensure_future(collect(worker.run(blocked_until(gate, "a"))))
        second = asyncio.ensure_future(collect(worker.run(blocked_until(gate, "b"))))
        await settle()
        admitted = worker.active
        try:
            await worker.run(items_of("c")).__anext__()
            refused = None
        except ApiError as exc:
            refused = exc
        gate.set()
        results = await first, await second
        assert admitted == 2
        assert refused is not None, "a third request was admitted"
        worker.close()
        return refused, results, worker.active
    refused, results, active = asyncio.run(scenario())
    assert refused.status == 503 and refused.kind == "server_overloaded"
    assert refused.headers == {"Retry-After": "1"}
    assert "the model is busy (2 requests running or queued)" in str(refused)
    assert results == (["a"], ["b"]) and active == 0


def test_a_queued_job_whose_client_left_never_starts():
    """A disconnect while queued cancels the job before it starts (mutation: receive not watched)."""
    async def scenario():
        gate = threading.Event()
        worker = ModelWorker(max_queue=2)
        ran = []

        def second(cancel):
            ran.append(True)
            yield "never"

        async def disconnected():
            return {"type": "http.disconnect"}

        first = asyncio.ensure_future(collect(worker.run(blocked_until(gate, "a"))))
        waiting = asyncio.ensure_future(collect(worker.run(second, receive=disconnected)))
        await settle()
        gate.set()
        results = await first, await waiting
        worker.close()
        return results, ran, worker
    results, ran, worker = asyncio.run(scenario())
    assert results == (["a"], [])
    assert ran == []
    assert (worker.started, worker.abandoned, worker.active) == (1, 1, 0)


def test_closing_the_stream_early_stops_the_job():
    """A client that stops reading cancels the running job at its next item (mutation: the job runs on)."""
    async def scenario():
        stopped = threading.Event()
        made = []

        def endless(cancel):
            try:
                while not cancel.is_set():
                    made.append(len(made))
                    yield made[-1]
            finally:
                stopped.set()

        worker = ModelWorker(max_queue=1)
        stream = worker.run(endless)
        first = await stream.__anext__()
        await stream.aclose()
        finished = await asyncio.to_thread(stopped.wait, WAIT)
        worker.close()
        return first, finished, worker
    first, finished, worker = asyncio.run(scenario())
    assert first == 0 and finished
    assert worker.abandoned == 1
