"""Which RL learning rate a real checkpoint tolerates: GRPO at several rates from
one SFT run, side by side.

    python benchmarks/rl_learning_rate.py --sft runs/gemma          # a finished SFT run
    (e.g. from real_models.py) python benchmarks/rl_learning_rate.py --sft runs/gemma
    --rates 1e-3 auto 1e-5 --steps 4

Each rate trains GRPO from the same SFT prior with the same seed, prompts and reward
(benchmarks/rewards.py brevity: shorter answers score higher, so every rate has something to climb).
Per iteration it prints the training reward, the KL to the reference, the policy's entropy, the mean
importance ratio and the clip fraction; at the end, the held-out reward before and after. A rate is
too high when KL and the clip fraction jump in the first iterations while entropy falls (the policy
leaves its prior faster than the reward can justify); too low when nothing moves. ``auto`` is the
size-scaled default (slm_align/rl/learning_rate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = """
[rl]
prompts_per_step = 2
group_size = 4
max_new_tokens = 32
eval_prompts = {eval_prompts}
report_prompts = 0
[headroom]
max_documents = 16
spread_prompts = 4
max_new_tokens = 16
"""
COLUMNS = ("reward/mean", "kl", "entropy", "ratio/mean", "clip_frac")


def train(sft: Path, out: Path, rate: str, steps: int, config: Path) -> dict:
    """One GRPO run; its per-iteration metrics and manifest metrics."""
    command = [sys.executable, "-m", "slm_align", "train", "--algo", "grpo", "--sft", str(sft), "--out", str(out),
               "--reward", "rewards:brevity", "--force", "--steps", str(steps), "--config", str(config), "--json"]
    if rate != "auto":
        command += ["--rl-lr", rate]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"rate {rate}: {done.stderr.strip().splitlines()[-1]}")
    lines = (out / "rl" / "metrics.jsonl").read_text().splitlines()
    return {"iterations": [json.loads(line) for line in lines], "metrics": json.loads(done.stdout)["metrics"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", type=Path, required=True, help="Run directory with a finished SFT stage.")
    parser.add_argument("--rates", nargs="+", default=["1e-3", "auto"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eval-prompts", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rl-lr-"))
    config = work / "settings.toml"
    config.write_text(SETTINGS.format(eval_prompts=args.eval_prompts))
    results = {rate: train(args.sft, work / f"lr-{rate}", rate, args.steps, config) for rate in args.rates}
    print(f"{'rate':>8} {'iter':>4} " + " ".join(f"{name:>12}" for name in COLUMNS))
    for result in results.values():
        used = result["metrics"].get("learning_rate")
        for index, row in enumerate(result["iterations"]):
            label = f"{used:.1e}" if index == 0 and used else ""
            print(f"{label:>8} {index:>4} " + " ".join(f"{row.get(name, float('nan')):>12.4f}" for name in COLUMNS))
    for rate, result in results.items():
        metrics = result["metrics"]
        print(f"rate {rate} ({metrics.get('learning_rate'):.1e}): held-out reward "
              f"{metrics['heldout_reward_sft']:.3f} -> {metrics['heldout_reward_rl']:.3f} "
              f"({metrics['heldout_reward_delta']:+.3f}); guard skips "
              f"{metrics['guard']['skipped']}, rollbacks {metrics['guard']['rollbacks']}")


if __name__ == "__main__":
    main()
