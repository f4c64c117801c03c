"""Many conversations in one llama.cpp context (slm_align.ondevice.agent.llama_batch): the runtime's Agent on a lane of
the batched decoder says what it says on today's one-conversation backend, whatever shares its steps."""

from __future__ import annotations

import re

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent import llama_batch
from slm_align.ondevice.agent.batching import Engine, run_many
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder
from slm_align.ondevice.agent.loading import load_model
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.tools.builtin import calculator, default_tools
from slm_align.ondevice.tools.registry import ToolRegistry
from tests.helpers import export_bundled

llama_cpp = pytest.importorskip("llama_cpp")
QUESTIONS = [f"What is {n} times {n + 3}? Then say why." for n in range(16)]
DIGITS = 'root ::= [0-9]+ "."'


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """Today's llama.cpp backend on the bundled model exported to GGUF Q8_0 (one thread)."""
    gguf = export_bundled(tmp_path_factory.mktemp("artifacts"), ("gguf", "Q8_0"))["gguf"]
    return load_model(gguf, threads=1).backend


class Recorder:
    """A backend that keeps the ids each round generated (and the logits they were drawn from)."""

    def __init__(self, inner, logits: bool = False):
        self.inner = inner
        self.rounds: list[list[int]] = []
        self.logits: list = []
        self.keep_logits = logits
        if logits and hasattr(inner, "want_logits"):
            inner.want_logits = True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        ids = []
        self.rounds.append(ids)
        for token in self.inner.generate(prompt, params, grammar):
            ids.append(token)
            if self.keep_logits:
                self.logits.append(self.inner.last_logits())
            yield token


def conversation(backend, index: int, temperature: float, tools=None, logits: bool = False):
    """Two turns of the runtime's loop with tools offered; every round's ids (and logits)."""
    recorder = Recorder(backend, logits)
    sampling = SamplingParams(temperature=temperature, seed=1000 + index, max_tokens=20)
    agent = Agent(recorder, "model", tools=tools or default_tools(), sampling=sampling, describe_tools=True)
    agent.chat(QUESTIONS[index % len(QUESTIONS)])
    agent.chat("And the next one?")
    return recorder


class Feeding(LlamaBatchDecoder):
    """Counts the ids its steps decode."""

    fed = 0

    def step(self, feeds):
        self.fed += sum(len(ids) for ids in feeds.values())
        return super().step(feeds)


def batched(backend, slots: int, items, work, keep_caches: bool = False, prompts_first: bool = False):
    decoder = Feeding(backend, slots)
    try:
        with Engine(decoder, keep_caches, prompts_first) as engine:
            results = run_many(engine, items, work)
        return results, engine, decoder
    finally:
        decoder.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_agent_conversation_says_the_same_alone_and_in_a_batch_of_16(backend, temperature):
    alone = [conversation(backend, i, temperature).rounds for i in range(16)]
    together, engine, _ = batched(backend, 16, range(16),
                                  lambda lane, i: conversation(lane, i, temperature).rounds)
    assert together == alone
    assert engine.stepped_rows / engine.steps > 1  # they did share forwards (how many: the host's timing)
    assert len({str(rounds) for rounds in alone}) > 8  # different conversations, not one repeated


def test_draws_come_from_the_same_logits_alone_and_batched(backend):
    """With prompts first (as ``serve`` runs), every step holds prompts only or one-id decodes only,
    as alone. A step that mixes a prompt with one-id decodes (the host's timing decides when)
    runs llama.cpp's matrix-matrix kernel for those rows, whose rounding differs from the
    matrix-vector one: a logit moved by 0.023 in one suite run, the tokens still the same."""
    alone = [conversation(backend, i, 0.9, logits=True) for i in range(6)]
    together, _, _ = batched(backend, 6, range(6), lambda lane, i: conversation(lane, i, 0.9, logits=True),
                             prompts_first=True)
    for one, many in zip(alone, together):
        assert one.rounds == many.rounds
        assert len(one.logits) == len(many.logits) > 0
        for a, b in zip(one.logits, many.logits):
            assert abs(a - b).max() < 1e-3


def second_logits(backend, prompts: dict[int, list[int]], monkeypatch=None, batches=None) -> dict:
    """Each slot's logits for its second token (greedy), the slots stepped together; with
    ``batches``, the sequence ids of every batch of the second step are recorded there."""
    decoder = LlamaBatchDecoder(backend, 4, prefix_bytes=0)
    real = llama_batch.decode_entries

    def recording(lib, ctx, entries):
        batches.append([sequence for _, _, sequence, _ in entries])
        return real(lib, ctx, entries)

    try:
        for slot, ids in prompts.items():
            decoder.begin(slot, SamplingParams(temperature=0.0), None, ids, True)
        first = decoder.step(prompts)
        if batches is not None:
            monkeypatch.setattr(llama_batch, "decode_entries", recording)
        second = decoder.step({slot: [first[slot].token] for slot in prompts})
    finally:
        decoder.close()
    return {slot: draw.logits for slot, draw in second.items()}


def test_a_step_hands_llama_cpp_its_slots_in_increasing_order(backend, monkeypatch):
    """llama.cpp (a KV stream per sequence) cuts a batch into micro-batches wherever a sequence id
    is not the previous one's + 1, a forward each: slots asked for as 3, 0, 1, 2 must reach it as
    0, 1, 2, 3 (one forward), and each slot still gets the logits of its own prompt."""
    prompts = {slot: backend.tokenize(QUESTIONS[slot]) for slot in (3, 0, 1, 2)}
    batches = []
    together = second_logits(backend, prompts, monkeypatch, batches)
    assert batches == [[0, 1, 2, 3]]
    alone = {slot: second_logits(backend, {slot: prompts[slot]})[slot] for slot in prompts}
    for slot in prompts:
        assert abs(together[slot] - alone[slot]).max() < 1e-3
    assert abs(alone[0] - alone[3]).max() > 1e-2  # different prompts, different rows


def test_conversations_are_admitted_mid_batch_and_leave_no_cache(backend):
    alone = [conversation(backend, i, 0.0).rounds for i in range(10)]
    seen = []

    def work(lane, index):
        seen.append((index, lane.engine.steps))
        return conversation(lane, index, 0.0).rounds

    together, engine, decoder = batched(backend, 4, range(10), work)
    assert together == alone
    assert max(steps for _, steps in seen) > 0  # some started after the engine had stepped others
    assert engine.stepped_rows / engine.steps <= 4
    assert decoder.positions == [0] * 4


def test_freed_slots_hold_nothing_in_llama_cpp_memory(backend):
    decoder = LlamaBatchDecoder(backend, 3)
    memory = llama_cpp.llama_get_memory(decoder.ctx)
    try:
        with Engine(decoder) as engine:
            run_many(engine, range(5), lambda lane, i: conversation(lane, i, 0.0).rounds)
            held = [llama_cpp.llama_memory_seq_pos_max(memory, slot) for slot in range(3)]
    finally:
        decoder.close()
    assert held == [-1, -1, -1]  # every sequence emptied (llama_memory_seq_rm) when its conversation ended


def exploding(expression: str) -> str:
    """A calculator that fails.

    Args:
        expression: what to compute
    """
    raise RuntimeError("the tool broke")


class FirstRoundScripted:
    """The first round answers with a scripted tool call; later rounds decode on the inner backend."""

    def __init__(self, inner, reply: str):
        self.inner = inner
        self.reply = reply

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        if self.reply is None:
            return self.inner.generate(prompt, params, grammar)
        reply, self.reply = self.reply, None
        return iter(self.inner.tokenize(reply, add_special=False) + [next(iter(self.inner.eos_ids))])


def tool_conversation(backend, index: int, broken: int):
    """One turn that calls a tool first (conversation ``broken`` calls the one that raises)."""
    name = "exploding" if index == broken else "calculator"
    call = f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{index} * 3"}}}}\n</tool_call>'
    tools = ToolRegistry()
    tools.register(calculator)
    tools.register(exploding)
    recorder = Recorder(FirstRoundScripted(backend, call))
    agent = Agent(recorder, "model", tools=tools, sampling=SamplingParams(temperature=0.0, max_tokens=40),
                  describe_tools=True)
    reply = agent.chat(QUESTIONS[index])
    return [call["ok"] for call in reply.tool_calls], recorder.rounds


def test_a_tool_that_raises_in_one_conversation_leaves_the_others_unchanged(backend):
    calm, _, _ = batched(backend, 8, range(8), lambda lane, i: tool_conversation(lane, i, broken=-1))
    stormy, _, _ = batched(backend, 8, range(8), lambda lane, i: tool_conversation(lane, i, broken=3))
    assert [oks for oks, _ in calm] == [[True]] * 8
    assert stormy[3][0] == [False] and stormy[3][1] != calm[3][1]
    assert [rounds for i, (_, rounds) in enumerate(stormy) if i != 3] == \
        [rounds for i, (_, rounds) in enumerate(calm) if i != 3]
    assert all(len(rounds) == 2 and rounds[1] for _, rounds in stormy)  # a decoded answer after the tool


def grammar_round(backend, index: int, temperature: float = 0.9) -> list[int]:
    """A round of conversation ``index``: even ones under a digits-only grammar, odd ones free."""
    prompt = backend.tokenize(QUESTIONS[index])
    params = SamplingParams(temperature=temperature, seed=7 + index, max_tokens=12)
    out = []
    for token in backend.generate(prompt, params, DIGITS if index % 2 == 0 else None):
        out.append(token)
        if token in backend.eos_ids or len(out) == params.max_tokens:
            break
    return out


def test_each_slot_samples_under_its_own_grammar(backend):
    alone = [grammar_round(backend, i) for i in range(6)]
    together, _, _ = batched(backend, 6, range(6), grammar_round)
    assert together == alone
    for index, ids in enumerate(together):
        text = backend.detokenize(ids).split("<|")[0]  # the grammar ends where the model's end tokens begin
        assert bool(re.fullmatch(r"[0-9]+\.", text)) == (index % 2 == 0)


def test_greedy_draws_under_a_grammar_check_one_token_and_equal_the_whole_chain(backend):
    """At temperature 0 the decoder tries the likeliest token against the grammar before it constrains the
    whole vocabulary: the tokens must be the whole chain's (today's backend), both ways taken."""
    alone = [grammar_round(backend, i, 0.0) for i in range(6)]
    together, _, decoder = batched(backend, 6, range(6), lambda lane, i: grammar_round(lane, i, 0.0))
    assert together == alone
    settled, handed_on = decoder.grammar_checks
    assert settled > 0 and handed_on > 0


def test_a_batch_llama_cpp_cannot_hold_is_refused_in_one_line(backend):
    with pytest.raises(UserError, match="--batch must be between 1 and"):
        LlamaBatchDecoder(backend, 0)


def test_a_slot_that_keeps_its_cache_feeds_only_what_the_next_conversation_does_not_share(backend):
    alone = [conversation(backend, i, 0.0).rounds for i in range(6)]
    emptied, _, cold = batched(backend, 2, range(6), lambda lane, i: conversation(lane, i, 0.0).rounds)
    kept, _, warm = batched(backend, 2, range(6), lambda lane, i: conversation(lane, i, 0.0).rounds, keep_caches=True)
    assert emptied == kept == alone
    assert warm.fed < cold.fed - 4 * 20  # four later conversations reused at least the system prompt's ids
