"""``evaluate-agent --batch N``: the episodes of one artifact run N at a time on a batching llama.cpp
engine (:mod:`slm_align.ondevice.agent.batching`, :mod:`slm_align.ondevice.agent.llama_batch`), each in an agent of its
own with the evaluation agent's settings; results in the plan's order, the same as one at a time
(each conversation's ids depend on its own prompt and seed only).

ONNX artifacts run one at a time: onnxruntime's session takes one cache of one length for all rows of
a batch, and conversations of different lengths would need a cache per row (or padding that changes
the numbers); llama.cpp keeps a cache per sequence.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

from slm_align.ondevice.agent.batching import Engine, Lane, run_many
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder
from slm_align.ondevice.agent.runtime import Agent

DEFAULT_BATCH = 8
"""Episodes decoded together by default: 8 caches of a small model's context fit a laptop's memory, and
on one thread a forward of 8 rows of SmolLM2-135M Q8_0 takes 3.5x one row's (75.5 against 21.8 ms;
16 rows 6.1x: 8 rows is most of what one core gains, docs/benchmarks.md)."""

PROMPTS_FIRST = True
"""Steps hold prompts only or one-id decodes only (``Engine(prompts_first=True)``), as one episode
alone runs them: a step mixing both runs llama.cpp's matrix-matrix kernel for the one-id rows, whose
rounding flipped 4 of 48 greedy replies of SmolLM2 Q8_0 against one at a time (docs/benchmarks.md).
Off: the mixed steps (``benchmarks/evaluate_batch.py --prompts-first off`` compares)."""

Item = TypeVar("Item")
Result = TypeVar("Result")


def inner_backend(agent: Agent):
    """``agent``'s backend inside the counter that wraps it."""
    return getattr(agent.backend, "inner", agent.backend)


def batches(agent: Agent, batch: int) -> bool:
    """Episodes on ``agent``'s model run ``batch`` at a time: batch > 1 and the model opened in
    llama.cpp (not ONNX, nor a backend that wraps one, as tests' scripted ones do)."""
    return batch > 1 and isinstance(inner_backend(agent), LlamaCppBackend)


def agent_on(lane: Lane, like: Agent, wrap: Callable) -> Agent:
    """A new agent on ``lane`` (wrapped by ``wrap``, e.g. a counter) with ``like``'s model id, tools,
    sampling, rounds and tool text."""
    return Agent(wrap(lane), like.base_id, tools=like.tools, sampling=like.sampling,
                 max_tool_rounds=like.max_tool_rounds, describe_tools=like.describe_tools)


def run_batched(agent: Agent, items: Sequence[Item], batch: int, wrap: Callable,
                work: Callable[[Agent, Item], Result], on_result: Callable[[Result], None]) -> list[Result]:
    """``work(agent_i, item)`` for every item, ``batch`` at a time on one batched llama.cpp context over
    ``agent``'s model (its backend inside ``agent.backend.inner`` when wrapped); ``on_result`` is called
    with each result as it comes (from the lanes' threads, one at a time)."""
    backend = inner_backend(agent)
    lock = threading.Lock()

    def one(lane: Lane, item: Item) -> Result:
        result = work(agent_on(lane, agent, wrap), item)
        with lock:
            on_result(result)
        return result

    decoder = LlamaBatchDecoder(backend, min(batch, len(items)))
    try:
        # episodes open alike: the system prompt's ids are reused (keep_caches)
        with Engine(decoder, keep_caches=True, prompts_first=PROMPTS_FIRST) as engine:
            return run_many(engine, items, one)
    finally:
        decoder.close()
