"""Prompt-prefix reuse in the batched llama.cpp decoder (slm_align.ondevice.agent.llama_prefix): a
prefix's K/V decoded once and copied into the slots whose prompts open with it; conversations say
the same token for token (and draw from the same logits) with reuse on and off, with fewer ids
decoded."""

from __future__ import annotations

import numpy as np
import pytest

from slm_align.ondevice.agent import llama_batch
from slm_align.ondevice.agent.batching import Engine, shared_prefix
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder
from slm_align.ondevice.agent.llama_prefix import MIN_SHARED
from slm_align.ondevice.agent.loading import load_model
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.tools.builtin import default_tools
from tests.helpers import export_bundled
from tests.ondevice.agent.test_llama_batch import Recorder

llama_cpp = pytest.importorskip("llama_cpp")
QUESTIONS = [f"What is {n} times {n + 3}? Then say why." for n in range(16)]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """Today's llama.cpp backend on the bundled model exported to GGUF Q8_0 (one thread)."""
    gguf = export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"))["gguf"]
    return load_model(gguf, threads=1).backend


@pytest.fixture
def decoded(monkeypatch):
    """Counts the ids llama.cpp decodes (every batch the decoder hands it)."""
    count = [0]
    real = llama_batch.decode_entries

    def counting(lib, ctx, entries):
        count[0] += len(entries)
        return real(lib, ctx, entries)

    monkeypatch.setattr(llama_batch, "decode_entries", counting)
    return count


def conversation(lane, index: int, temperature: float) -> Recorder:
    """Two turns of the runtime's loop with tools described (a long shared system prompt)."""
    recorder = Recorder(lane, logits=True)
    sampling = SamplingParams(temperature=temperature, seed=1000 + index, max_tokens=12)
    agent = Agent(recorder, "model", tools=default_tools(), sampling=sampling, describe_tools=True)
    agent.chat(QUESTIONS[index % len(QUESTIONS)])
    agent.chat("And the next one?")
    return recorder


def one_at_a_time(backend, count: int, temperature: float, prefix_bytes: int):
    """``count`` conversations one after another on a decoder of 2 slots (each step holds one
    slot: the batches llama.cpp sees differ only by the ids a copy saves)."""
    decoder = LlamaBatchDecoder(backend, 2, prefix_bytes=prefix_bytes)
    try:
        with Engine(decoder) as engine:
            recorders = []
            for index in range(count):
                with engine.lane() as lane:
                    recorders.append(conversation(lane, index, temperature))
        return recorders, decoder
    finally:
        decoder.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_copied_prefix_says_what_a_prefilled_one_says_with_fewer_ids_decoded(
        backend, decoded, temperature):
    cold, off = one_at_a_time(backend, 5, temperature, prefix_bytes=0)
    cold_ids = decoded[0]
    decoded[0] = 0
    warm, on = one_at_a_time(backend, 5, temperature, prefix_bytes=2**26)
    assert [r.rounds for r in warm] == [r.rounds for r in cold]
    for one, other in zip(warm, cold):
        assert len(one.logits) == len(other.logits) > 0
        assert all(np.array_equal(a, b) for a, b in zip(one.logits, other.logits))  # bit for bit
    assert off.prefixes.copied_ids == 0
    assert on.prefixes.copied_ids >= 4 * MIN_SHARED  # every conversation after the first
    assert decoded[0] == cold_ids - on.prefixes.copied_ids  # each copied id is one not decoded
    assert len({str(r.rounds) for r in cold}) > 1  # different conversations, not one repeated


def prompts(backend, count: int) -> list[list[int]]:
    """Chat prompts that open alike (the tool descriptions) and differ in their question."""
    agent = Agent(backend, "model", tools=default_tools(), describe_tools=True)
    chats = [[{"role": "user", "content": QUESTIONS[i]}] for i in range(count)]
    return [agent.prompt_tokens(chat, 16)[0] for chat in chats]


def greedy_together(backend, feeds: list[list[int]], prefix_bytes: int, steps: int = 10):
    """Every prompt fed in one step, then ``steps`` greedy tokens each, all slots stepped
    together."""
    decoder = LlamaBatchDecoder(backend, len(feeds), prefix_bytes=prefix_bytes)
    params = SamplingParams(temperature=0.0)
    try:
        for slot, ids in enumerate(feeds):
            decoder.begin(slot, params, None, ids, True)
        draws = decoder.step(dict(enumerate(feeds)))
        out = {slot: [draw.token] for slot, draw in draws.items()}
        logits = {slot: [draw.logits] for slot, draw in draws.items()}
        for _ in range(steps):
            draws = decoder.step({slot: tokens[-1:] for slot, tokens in out.items()})
            for slot, draw in draws.items():
                out[slot].append(draw.token)
                logits[slot].append(draw.logits)
        return out, logits, decoder.prefixes.copied_ids, decoder.prefilled
    finally:
        decoder.close()


def alone(backend, prompt: list[int], count: int) -> list[int]:
    """Today's one-conversation backend's first ``count`` greedy tokens after ``prompt``."""
    out = []
    for token in backend.generate(prompt, SamplingParams(temperature=0.0)):
        out.append(token)
        if len(out) == count:
            return out
    return out


def test_prompts_arriving_in_one_step_decode_their_shared_prefix_once(backend):
    """Six prompts in one step: the first one's shared ids are decoded once and copied into the
    other five; every slot's greedy tokens (past the end token too) and logits are those without
    copies, and the tokens today's one-conversation backend gives."""
    feeds = prompts(backend, 6)
    common = min(shared_prefix(feeds[0], other) for other in feeds[1:])
    assert common > 50  # the tool descriptions
    reference = {slot: alone(backend, ids, 11) for slot, ids in enumerate(feeds)}
    cold, cold_logits, copied_off, prefilled_off = greedy_together(backend, feeds, prefix_bytes=0)
    warm, warm_logits, copied_on, prefilled_on = greedy_together(backend, feeds, prefix_bytes=2**26)
    assert warm == cold == reference
    for slot in cold:
        assert all(np.array_equal(a, b) for a, b in zip(warm_logits[slot], cold_logits[slot]))
    assert copied_off == 0
    assert copied_on >= 5 * (common - 1)  # the five others copy the first's prefix
    assert prefilled_on == prefilled_off - copied_on
    assert len({str(ids) for ids in warm.values()}) > 1


def test_snapshots_stay_within_their_bytes(backend):
    _, small = one_at_a_time(backend, 3, 0.0, prefix_bytes=2**12)
    assert small.prefixes.snapshots == []  # a prompt's K/V exceeds 4 KiB
    assert small.prefixes.copied_ids == 0
    feeds = prompts(backend, 3)
    decoder = LlamaBatchDecoder(backend, 3, prefix_bytes=2**26)
    try:
        for slot in range(3):
            decoder.begin(slot, SamplingParams(temperature=0.0), None, feeds[slot], False)
        decoder.step({0: feeds[0]})
        one = decoder.prefixes.bytes
        decoder.prefixes.max_bytes = one + one // 2  # room for one snapshot of these prompts
        decoder.crop(0, 0)
        decoder.step({1: [999] * 5 + feeds[1]})  # shares nothing: a new snapshot, the first dropped
        assert len(decoder.prefixes.snapshots) == 1
        assert decoder.prefixes.bytes <= decoder.prefixes.max_bytes
        assert decoder.prefixes.snapshots[0].ids[:5] == (999,) * 5
    finally:
        decoder.close()


def test_new_adapters_drop_the_snapshots(backend):
    """Snapshots hold K/V computed with the weights of their time: applying adapters drops them."""
    feeds = prompts(backend, 1)
    decoder = LlamaBatchDecoder(backend, 2, prefix_bytes=2**26)
    try:
        decoder.begin(0, SamplingParams(temperature=0.0), None, feeds[0], False)
        decoder.step({0: feeds[0]})
        assert len(decoder.prefixes.snapshots) == 1
        decoder.apply_adapters()
        assert decoder.prefixes.snapshots == [] and decoder.positions == [0, 0]
    finally:
        decoder.close()
