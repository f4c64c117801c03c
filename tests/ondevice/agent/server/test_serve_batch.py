"""`serve` on a GGUF model: concurrent requests decode together on the batched llama.cpp engine, a client
that leaves frees its slot, and /health answers while the model decodes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from slm_align.errors import UserError
from slm_align.export.publishing.request import ExportRequest
from slm_align.export.publishing.stage import run_export
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.server import create_app
from slm_align.ondevice.agent.settings import SamplingParams
from tests.ondevice.agent.server.test_serve import Running, wait_until

llama_cpp = pytest.importorskip("llama_cpp")
LONG = {"model": "m", "messages": [{"role": "user", "content": "Tell me about a cat."}], "temperature": 0,
        "max_tokens": 48, "stream": True}  # the bundled model's greedy answer runs to max_tokens


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "gguf", "Q8_0", out=out, verify=False)).stage_dir


def pieces(url: str, request: dict) -> list[tuple[float, str]]:
    """(arrival time, text) of each streamed piece of the answer."""
    out = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=60) as response:
        for line in response.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                out.append((time.monotonic(), line))
    return out


def slowed(engine, seconds: float) -> None:
    """Each step of the engine's decoder takes ``seconds`` longer (a model that is slow to decode)."""
    step = engine.decoder.step

    def slow(feeds):
        time.sleep(seconds)
        return step(feeds)

    engine.decoder.step = slow


def test_two_concurrent_requests_both_progress_before_either_finishes(gguf):
    expected = Agent.load(gguf, sampling=SamplingParams(temperature=0, max_tokens=48)).chat(
        LONG["messages"][0]["content"]).text
    with Running(create_app(gguf, batch=2)) as running:
        engine = running.service.engine
        slowed(engine, 0.01)
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(lambda _: pieces(running.url, LONG), range(2))
        answer = running.client().chat.completions.create(**{**LONG, "stream": False}).choices[0].message.content
    assert len(first) > 10 and len(second) > 10
    assert first[0][0] < second[-1][0] and second[0][0] < first[-1][0]  # interleaved, not one after the other
    assert engine.stepped_rows > engine.steps  # some steps advanced both
    assert answer == expected  # the same answer as the runtime gives alone


def test_a_client_that_leaves_frees_its_slot_and_health_answers_meanwhile(gguf):
    with Running(create_app(gguf, batch=2)) as running:
        engine, decoder = running.service.engine, running.service.engine.decoder
        slowed(engine, 0.05)
        health = lambda: httpx.get(f"{running.url}/health", timeout=5).json()  # noqa: E731
        with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=LONG, timeout=60) as response:
            lines = (line for line in response.iter_lines() if '"content": "' in line)
            next(lines)
            busy = health()  # answered while the model decodes
        wait_until(lambda: health()["active_requests"] == 0, "the server notices the client left")
        wait_until(lambda: len(engine._free) == 2, "the slot is freed")
        rows = engine.stepped_rows
        memory = llama_cpp.llama_get_memory(decoder.ctx)
        held = [llama_cpp.llama_memory_seq_pos_max(memory, slot) for slot in range(2)]
        after = health()
        answer = running.client().chat.completions.create(**{**LONG, "stream": False})
    assert busy["status"] == "ok" and busy["active_requests"] == 1
    assert after["abandoned_requests"] == 1 and rows < 48  # it stopped long before max_tokens
    assert held == [-1, -1] and decoder.positions[0] == 0  # its cache emptied
    assert answer.choices[0].finish_reason == "length"  # serving goes on


def test_a_full_queue_still_answers_503_with_a_batch(gguf):
    """Bounds unchanged: ``batch`` requests decode, ``max_queue`` wait, one more is refused."""
    gate = threading.Event()
    with Running(create_app(gguf, batch=2, max_queue=0)) as running:
        engine = running.service.engine
        step = engine.decoder.step

        def held(feeds):
            assert gate.wait(timeout=60)
            return step(feeds)

        engine.decoder.step = held
        body = {**LONG, "stream": False, "max_tokens": 2}
        with ThreadPoolExecutor(2) as pool:
            running_two = [pool.submit(running.post, "/v1/chat/completions", body) for _ in range(2)]
            wait_until(lambda: running.service.worker.active == 2, "two requests decode")
            refused = running.post("/v1/chat/completions", body)
            gate.set()
            answered = [future.result().status_code for future in running_two]
    assert refused.status_code == 503 and answered == [200, 200]


def test_batch_below_1_is_refused_in_one_line(gguf):
    with pytest.raises(UserError, match="--batch must be an integer >= 1"):
        create_app(gguf, batch=0)
