"""The engine that advances many conversations at once (slm_align.ondevice.agent.batching), over a toy decoder whose
logits follow each slot's own history: a lane must get its own slot's draws, whatever shares its step."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from slm_align.ondevice.agent.batching import Draw, Engine, run_many, shared_prefix
from slm_align.ondevice.agent.sampling import sample_token
from slm_align.ondevice.agent.settings import SamplingParams

VOCAB = 40
STOP = 0


class ToyDecoder:
    """Per-slot caches of ids; a slot's logits are a fixed function of its cached ids, its draws come from a
    numpy generator seeded per round. Counts what the engine asks of it."""

    kind = "toy"
    n_ctx = 256
    vocab_size = VOCAB
    eos_ids = {STOP}
    chat_template = None
    chat_template_origin = None
    bos_token = None
    eos_token = None

    def __init__(self, slots: int, fail_when=None):
        self.slots = slots
        self.caches = {slot: [] for slot in range(slots)}
        self.samplers = {}
        self.batches: list[list[int]] = []
        self.most_cached = 0
        self.fail_when = fail_when

    def tokenize(self, text, add_special=True, special=True):
        return [ord(c) % VOCAB for c in text]

    def detokenize(self, ids):
        return " ".join(map(str, ids))

    def crop(self, slot, keep):
        self.caches[slot] = self.caches[slot][:keep]

    def begin(self, slot, params, grammar, prompt, logits):
        self.samplers[slot] = (params, np.random.default_rng(params.seed + len(prompt)), logits)

    def step(self, feeds):
        self.batches.append(sorted(feeds))
        if self.fail_when is not None and self.fail_when(feeds):
            raise RuntimeError("the forward failed")
        draws = {}
        for slot, ids in feeds.items():
            self.caches[slot] = self.caches[slot] + list(ids)
            logits = history_logits(self.caches[slot])
            params, rng, keep = self.samplers[slot]
            draws[slot] = Draw(sample_token(logits, params, rng), logits if keep else None)
        self.most_cached = max(self.most_cached, sum(len(c) for c in self.caches.values()))
        return draws


def history_logits(ids: list[int]) -> np.ndarray:
    """Logits that depend on the whole history (its sum and length), favouring the stop id once it is long."""
    rng = np.random.default_rng(sum(ids) * 7919 + len(ids))
    logits = rng.normal(size=VOCAB).astype(np.float32)
    logits[STOP] += len(ids) / 6.0
    return logits


def conversation(lane, prompt: list[int], seed: int, temperature: float = 0.8, rounds: int = 2,
                 pause: float = 0.0) -> list[list[int]]:
    """Rounds of sampling as the runtime's loop does them: each round's prompt is the last one, its
    sampled ids and two inserted ids."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=12)
    out = []
    for round_index in range(rounds):
        sampled = []
        for token in lane.generate(prompt, params):
            sampled.append(token)
            if token == STOP or len(sampled) == params.max_tokens:
                break
        out.append(sampled)
        time.sleep(pause)  # a tool running in this conversation's thread
        prompt = prompt + sampled + [5 + round_index, 6]
    return out


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, VOCAB, size=int(rng.integers(3, 9)))) for _ in range(n)]


def alone(items, **kwargs):
    with Engine(ToyDecoder(slots=1)) as engine:
        return run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1], **kwargs))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_conversation_draws_the_same_alone_and_in_a_batch_of_16(temperature):
    items = [(p, 100 + i) for i, p in enumerate(prompts(16))]
    decoder = ToyDecoder(slots=16)
    with Engine(decoder) as engine:
        batched = run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1], temperature))
    assert batched == alone(items, temperature=temperature)
    assert max(len(batch) for batch in decoder.batches) > 1  # they did share steps (how many: the host's timing)
    assert engine.steps < sum(len(r) for rounds in batched for r in rounds)


def test_conversations_waiting_are_admitted_as_slots_free():
    items = [(p, i) for i, p in enumerate(prompts(10))]
    decoder = ToyDecoder(slots=3)
    with Engine(decoder) as engine:
        batched = run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1]))
    assert batched == alone(items)
    assert max(len(batch) for batch in decoder.batches) <= 3
    assert all(cache == [] for cache in decoder.caches.values())  # every slot emptied on its way out


def test_a_round_that_extends_the_last_feeds_only_the_new_ids():
    decoder = ToyDecoder(slots=1)
    with Engine(decoder) as engine, engine.lane() as lane:
        first = conversation(lane, [3, 4, 5], seed=1, rounds=1)[0]
        fed_before = len(decoder.batches)
        following = [3, 4, 5] + first + [7, 8]
        next(lane.generate(following, SamplingParams(temperature=0.0, seed=1)))
    assert len(decoder.batches) == fed_before + 1
    assert decoder.caches == {0: []}  # emptied when the lane was given back
    assert shared_prefix([3, 4, 5, 9], [3, 4, 6]) == 2


def test_a_conversation_that_raises_leaves_the_others_untouched():
    items = [(p, i) for i, p in enumerate(prompts(8))]

    def work(lane, item):
        if item[1] == 3:
            next(lane.generate(item[0], SamplingParams(temperature=0.8, seed=3)))
            raise ValueError("the tool of conversation 3 raised")
        return conversation(lane, item[0], item[1])

    decoder = ToyDecoder(slots=8)
    with Engine(decoder) as engine:
        with pytest.raises(ValueError, match="conversation 3"):
            run_many(engine, items, work)
        survivors = [item for item in items if item[1] != 3]
        again = run_many(engine, survivors, work)
    assert again == alone(survivors)


def test_a_conversation_that_stops_asking_frees_the_step_for_the_others():
    """A cancelled answer closes its generator mid-round: the engine must not wait for it (each later step
    would otherwise wait out the gathering time) and its slot must come back."""
    decoder = ToyDecoder(slots=2)
    with Engine(decoder) as engine:
        with engine.lane() as cancelled:
            tokens = cancelled.generate([1, 2, 3], SamplingParams(temperature=0.8, seed=0))
            next(tokens)
            tokens.close()
            assert cancelled.slot not in engine._active
        with engine.lane() as first, engine.lane() as second:
            assert {first.slot, second.slot} == {0, 1}


def test_a_failed_forward_reaches_the_lanes_in_it_and_the_engine_goes_on():
    calls = {"n": 0}

    def fail_once(feeds):
        calls["n"] += 1
        return calls["n"] == 3

    decoder = ToyDecoder(slots=4, fail_when=fail_once)
    items = [(p, i) for i, p in enumerate(prompts(4))]
    with Engine(decoder) as engine:
        with pytest.raises(RuntimeError, match="the forward failed"):
            run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1]))
        assert run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1])) == alone(items)


def test_memory_stays_bounded_as_conversations_come_and_go():
    decoder = ToyDecoder(slots=4)
    items = [(p, i) for i, p in enumerate(prompts(40))]
    with Engine(decoder) as engine:
        run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1], rounds=3))
    longest = max(len(p) for p, _ in items) + 3 * (12 + 2)
    assert decoder.most_cached <= 4 * longest
    assert all(cache == [] for cache in decoder.caches.values())


def test_a_tool_running_in_one_conversation_does_not_stop_the_others():
    """While one conversation sleeps in its tool, the engine steps the rest (after the gathering time)."""
    items = [(p, i) for i, p in enumerate(prompts(4))]
    decoder = ToyDecoder(slots=4)
    started = threading.Event()

    def work(lane, item):
        if item[1] == 0:
            out = conversation(lane, item[0], 0, rounds=1)
            started.set()
            time.sleep(0.3)
            return out
        started.wait()
        return conversation(lane, item[0], item[1], rounds=1)

    with Engine(decoder) as engine:
        results = run_many(engine, items, work)
    assert results == alone(items, rounds=1)


def test_logits_are_kept_only_when_asked():
    with Engine(ToyDecoder(slots=1)) as engine, engine.lane() as lane:
        next(lane.generate([1, 2], SamplingParams(temperature=0.0)))
        with pytest.raises(RuntimeError, match="no logits"):
            lane.last_logits()
        lane.want_logits = True
        token = next(lane.generate([1, 2, 9], SamplingParams(temperature=0.0)))
        assert token == int(np.argmax(lane.last_logits()))


class FeedRecorder(ToyDecoder):
    """Keeps the length of every slot's feed in every step."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self.feeds: list[list[int]] = []

    def step(self, feeds):
        self.feeds.append([len(ids) for ids in feeds.values()])
        return super().step(feeds)


def test_prompts_first_steps_prompts_apart_from_the_lanes_decoding():
    items = list(zip(prompts(10), range(10)))
    reference = alone(items)
    decoder = FeedRecorder(slots=4)
    with Engine(decoder, prompts_first=True) as engine:
        results = run_many(engine, items, lambda lane, item: conversation(lane, item[0], item[1]))
    assert results == reference
    prompt_steps = [lengths for lengths in decoder.feeds if max(lengths) > 1]
    assert prompt_steps and len(prompt_steps) < len(decoder.feeds)
    assert all(min(lengths) > 1 for lengths in prompt_steps)  # no prompt beside a decode
    assert max(len(lengths) for lengths in decoder.feeds) > 1  # and the decodes still share steps
