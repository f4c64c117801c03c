"""Peak memory and time per step of every training stage at its default settings, against TRL's
GRPOTrainer, and how time per GRPO iteration grows with completion length and group size.

Model: a Llama of SmolLM2-135M's shape (30 layers, d=576, GQA 9/3, 49152-row tied embeddings) with
random weights, saved with the bundled tokenizer (738 tokens): prompts use small ids, but every
forward pass projects onto all 49152 rows and the weights, LoRA, optimizer state and logits have the
real model's sizes. Random weights almost never sample EOS, so completions run to max_new_tokens
(the table shows the mean completion length).

Memory table. Each row runs in a fresh subprocess (`torch.set_num_threads(--threads)`) through the
Python API, at the recipe's defaults except the step count (`sft.max_steps`, `reward.max_steps`,
`rl.steps` = --steps; memory peaks in the first steps) and `force=True` for RL (random weights fail
the headroom gate's perplexity check; the manifest records it). The peak is the kernel's RSS
high-water mark, VmHWM from /proc/self/status, read in the child. The child also writes "5" to
/proc/self/clear_refs just before the first training step, which resets VmHWM, so each row splits
into *setup* (model load, data, the gate, ...: the peak before the first step) and *steps* (the peak
during the training steps alone); the stage peak is the larger of the two, plus anything after the
steps (final eval, merge). "rollout" is the peak from the first step's start to the end of its
rollout (sampling, log-probabilities under policy and reference, rewards), so the part of "steps"
above it comes from the updates. Weights that safetensors maps from disk count in RSS only once
touched, so "setup" can be below the model's size. Seconds per step: median over steps after the
first (SFT, reward: one optimizer step of `batch_size` sequences; RL: one iteration = rollout +
`epochs` passes in minibatches).

    sft            run_sft: LoRA + NEFTune on transformers' Trainer (+ eval at the end of the epoch
    and after) reward         run_reward: Bradley-Terry classifier on the merged SFT weights (+
    merge, held-out accuracy) grpo / ppo     run_rl: headroom gate, held-out reward before and
    after, the loop with the learned reward model grpo loop      benchmarks/grpo_vs_trl.py's runner:
    the same loop on the base model with the length reward TRL GRPO
    benchmarks/grpo_vs_trl.py's TRL runner: GRPOTrainer, same model, LoRA, G, prompts, tokens, beta

"grpo loop" and "TRL GRPO" run the same work (no SFT adapter, no reward model, no gate) and give the
ratio; the "grpo" stage row additionally holds the reward model and runs the gate. Both runners take
the RL defaults from `RLSettings()` (prompts_per_step, group_size, max_new_tokens, epochs,
minibatch_size, beta; LoRA r=16 on q/k/v/o).

Scale tables. Our GRPO loop (and TRL's unless --skip-trl), each setting in a fresh subprocess:
max_new_tokens in (16, 32, 64) at the default G, and G in (2, 4, 8) at the default max_new_tokens;
median seconds per iteration over --scale-iterations iterations after one warm-up, and the growth
factor against the smallest setting.

    python benchmarks/memory_and_scale.py --threads 1              # needs `pip install trl`;
    about an hour python benchmarks/memory_and_scale.py --skip-trl --scale-model bundled
    python benchmarks/memory_and_scale.py --quick --scale-model bundled --memory-model
    bundled   # a check it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_and_decode import smollm2_shaped
from grpo_vs_trl import LORA, run_ours, run_trl


# ---- inside a child: the high-water mark and per-step stamps -------------------------------------
def peak_mib() -> float:
    """The process's RSS high-water mark (VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Probe:
    """Peak before the first step (then reset), step boundaries, peak during the steps."""

    def __init__(self):
        self.setup_mib = None
        self.reset = False
        self.stamps: list[float] = []
        self.steps_mib = None
        self.rollout_mib = None
        self.completion_lengths: list[float] = []

    def begin(self) -> None:
        if self.setup_mib is None:
            self.setup_mib = peak_mib()
            self.reset = reset_peak()
            self.stamps.append(time.perf_counter())

    def rollout_done(self) -> None:
        if self.rollout_mib is None and self.reset:  # the first rollout: sampling, log-probs, rewards
            self.rollout_mib = peak_mib()

    def step_done(self) -> None:
        self.stamps.append(time.perf_counter())
        self.steps_mib = peak_mib()

    def result(self) -> dict:
        times = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        final = peak_mib()
        return {"setup_mib": self.setup_mib, "steps_mib": self.steps_mib if self.reset else None,
                "rollout_mib": self.rollout_mib,
                "peak_mib": max(self.setup_mib or 0.0, final), "step_times": times,
                "seconds_per_step": statistics.median(times[1:] or times) if times else None,
                "completion_length": statistics.fmean(self.completion_lengths) if self.completion_lengths else None,
                "peak_reset_supported": self.reset}


def wrap(owner, name: str, before=None, after=None) -> None:
    """Replace ``owner.name`` by a function calling ``before(*args)`` and
    ``after(result)`` around it."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before:
            before(*args)
        result = original(*args, **kwargs)
        if after:
            after(result)
        return result

    setattr(owner, name, wrapped)


def instrument_rl(probe: Probe) -> None:
    from slm_align.rl import grpo, learner, ppo

    def done(metrics):
        probe.completion_lengths.append(metrics["completion/length"])
        probe.step_done()

    for algorithm in (ppo.PPO, grpo.GRPO):
        wrap(algorithm, "run_step", before=lambda *_: probe.begin(), after=done)
    wrap(learner.Learner, "collect_rollout", after=lambda _: probe.rollout_done())


def instrument_trainer(probe: Probe) -> None:
    from slm_align.envelope.trainer import TrainerProgress

    wrap(TrainerProgress, "on_train_begin", before=lambda *_: probe.begin())
    wrap(TrainerProgress, "on_step_end", after=lambda _: probe.step_done())


def instrument_trl(probe: Probe) -> None:
    """TRL generates once per iteration, at its start: each generation call is
    an iteration boundary."""
    from trl import GRPOTrainer

    def generated(output):
        mask = output.get("completion_mask")
        if mask is not None:
            probe.completion_lengths.append(float(mask.sum(-1).float().mean()))
        probe.rollout_done()

    calls = []

    def generating(*_):  # the first call starts iteration 1, whose start train() already stamped
        if calls:
            probe.stamps.append(time.perf_counter())
        calls.append(1)

    wrap(GRPOTrainer, "train", before=lambda *_: probe.begin(), after=lambda _: probe.step_done())
    wrap(GRPOTrainer, "_generate_and_score_completions", before=generating, after=generated)


def runner_args(spec: dict) -> argparse.Namespace:
    """The namespace grpo_vs_trl's runners read, with RLSettings' defaults unless
    the spec says otherwise."""
    from slm_align.config import RLSettings

    d = RLSettings()
    return argparse.Namespace(model=spec["model"], threads=spec["threads"], iterations=spec["steps"],
                              prompts=spec.get("prompts", d.prompts_per_step),
                              group_size=spec.get("group_size", d.group_size),
                              max_new_tokens=spec.get("max_new_tokens", d.max_new_tokens), epochs=d.epochs,
                              minibatch=d.minibatch_size, beta=d.grpo.beta)


def child(spec: dict) -> dict:
    import torch

    from slm_align.config import load_recipe

    torch.set_num_threads(spec["threads"])
    probe = Probe()
    kind, steps, base = spec["kind"], spec["steps"], Path(spec.get("out", "."))
    recipe = load_recipe(overrides={"model.source": spec["model"], "sft.max_steps": steps,
                                    "reward.max_steps": steps, "rl.steps": steps,
                                    "rl.algo": kind if kind in ("grpo", "ppo") else None})
    if kind == "sft":
        from slm_align.sft.stage import run_sft

        instrument_trainer(probe)
        run_sft(recipe, base)
    elif kind == "reward":
        from slm_align.reward_model.stage import run_reward

        instrument_trainer(probe)
        run_reward(recipe, base)
    elif kind in ("grpo", "ppo"):
        from slm_align.pipeline import run_rl

        instrument_rl(probe)
        result = run_rl(recipe, base / kind, force=True, sft_from=base, reward_model=base / "reward" / "model")
        assert result.metrics["gate"]["forced"] or result.metrics["gate"]["verdict"] == "PASS", result.metrics["gate"]
    elif kind == "loop":
        instrument_rl(probe)
        run_ours(runner_args(spec))
    elif kind == "trl":
        instrument_trl(probe)
        run_trl(runner_args(spec))
    else:
        raise ValueError(kind)
    return probe.result()


def measure(spec: dict) -> dict:
    """Run one measurement in a fresh interpreter; its last stdout line is the JSON result."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{spec['kind']} failed (exit {done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    print(f"  [{spec['kind']}{'' if 'label' not in spec else ' ' + spec['label']}] peak "
          f"{result['peak_mib']:.0f} MiB, {result['seconds_per_step'] or float('nan'):.2f} s/step, "
          f"{result['wall_s']:.0f} s wall", flush=True)
    return result


# ---- the parent: tables --------------------------------------------------------------------------
def fmt(value, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def memory_table(rows: dict[str, dict]) -> None:
    print(f"\n{'stage':11}{'peak MiB':>10}{'setup':>8}{'steps':>8}{'rollout':>9}{'s/step':>9}{'compl.len':>11}")
    for name, r in rows.items():
        print(f"{name:11}{r['peak_mib']:10.0f}{fmt(r['setup_mib'], '8.0f')}{fmt(r['steps_mib'], '8.0f')}"
              f"{fmt(r.get('rollout_mib'), '9.0f')}{fmt(r['seconds_per_step'], '9.2f')}"
              f"{fmt(r['completion_length'], '11.1f')}")
    if "TRL GRPO" in rows:
        trl = rows["TRL GRPO"]
        for name in ("grpo loop", "grpo"):
            ours = rows[name]
            steps = f"{ours['steps_mib'] / trl['steps_mib']:.2f}x" if ours["steps_mib"] and trl["steps_mib"] else "-"
            print(f"{name} / TRL GRPO: peak RSS {ours['peak_mib'] / trl['peak_mib']:.2f}x, "
                  f"steps-only RSS {steps}, time per iteration "
                  f"{ours['seconds_per_step'] / trl['seconds_per_step']:.2f}x")


def scale_table(title: str, key: str, values: list[int], results: dict[str, dict[int, dict]]) -> None:
    sides = list(results)
    print(f"\n{title}")
    print(f"{key:>16}" + "".join(f"{side + ' s/it':>16}{'growth':>8}{'MiB':>7}" for side in sides))
    for v in values:
        cells = ""
        for side in sides:
            r, base = results[side][v], results[side][values[0]]
            cells += (f"{r['seconds_per_step']:16.2f}{r['seconds_per_step'] / base['seconds_per_step']:7.2f}x"
                      f"{r['peak_mib']:7.0f}")
        print(f"{v:>16}" + cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps of SFT and reward, "
                                                             "iterations of RL (default 3)")
    parser.add_argument("--skip-trl", action="store_true", help="measure our stages only")
    parser.add_argument("--scale-model", choices=["smollm2", "bundled"], default="smollm2",
                        help="model of the scale grid (the memory table "
                             "always uses the 135M shape)")
    parser.add_argument("--scale-iterations", type=int, default=2, help="timed iterations per grid point")
    parser.add_argument("--quick", action="store_true",
                        help="smallest grid: 2 steps, lengths 8/16, G 2/4, 1 timed "
                             "iteration; a check that it runs")
    parser.add_argument("--memory-model", choices=["smollm2", "bundled"], default="smollm2",
                        help="model of the memory table (bundled: a fast check of the script)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads per run; use 1 on a busy machine (2 threads "
                             "on 2 shared cores stall)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from slm_align.config import RLSettings

    defaults = RLSettings()
    assert defaults.lora.r == LORA["r"] and defaults.lora.alpha == LORA["lora_alpha"], "grpo_vs_trl's LoRA drifted"
    steps = 2 if args.quick else args.steps
    lengths, groups = ([8, 16], [2, 4]) if args.quick else ([16, 32, 64], [2, 4, 8])
    scale_steps = 1 if args.quick else args.scale_iterations
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slm-align-memscale-") as tmp:
        model_dir = str(smollm2_shaped(Path(tmp) / "smollm2-135m-shaped"))
        models = {"smollm2": model_dir, "bundled": None}
        memory_model = models[args.memory_model]
        shape = "SmolLM2-135M-shaped Llama (random weights, bundled 738-token tokenizer)"
        print(f"memory: {shape if memory_model else 'bundled model'}; recipe defaults except "
              f"sft.max_steps = reward.max_steps = rl.steps = {steps} and force=True for RL; RL: "
              f"{defaults.prompts_per_step} prompts x G={defaults.group_size}, "
              f"{defaults.max_new_tokens} new tokens, {defaults.epochs} epochs of minibatch "
              f"{defaults.minibatch_size}, LoRA r={defaults.lora.r}, beta={defaults.grpo.beta}; "
              f"fp32, {args.threads} thread(s)", flush=True)
        common = {"model": memory_model, "threads": args.threads, "steps": steps, "out": str(Path(tmp) / "run")}
        rows = {}
        for kind, name in (("sft", "sft"), ("reward", "reward"), ("grpo", "grpo"), ("ppo", "ppo"),
                           ("loop", "grpo loop")) + ((("trl", "TRL GRPO"),) if not args.skip_trl else ()):
            rows[name] = measure(dict(common, kind=kind))
        memory_table(rows)

        scale_model = models[args.scale_model]
        sides = ("loop",) if args.skip_trl else ("loop", "trl")
        names = {"loop": "slm-align", "trl": "TRL"}
        by_length = {names[s]: {} for s in sides}
        by_group = {names[s]: {} for s in sides}
        print(f"\nscale: {'SmolLM2-135M-shaped' if scale_model else 'bundled'} model, "
              f"{defaults.prompts_per_step} prompts per iteration, median of {scale_steps} timed "
              f"iteration(s) after a warm-up", flush=True)
        for side in sides:
            point = {"model": scale_model, "threads": args.threads, "steps": scale_steps, "kind": side}
            for n in lengths:
                reuse = n == defaults.max_new_tokens and scale_model == memory_model
                by_length[names[side]][n] = rows["grpo loop" if side == "loop" else "TRL GRPO"] if reuse else \
                    measure(dict(point, max_new_tokens=n, label=f"tokens={n}"))
            for g in groups:
                reuse = g == defaults.group_size and scale_model == memory_model
                by_group[names[side]][g] = rows["grpo loop" if side == "loop" else "TRL GRPO"] if reuse else \
                    measure(dict(point, group_size=g, label=f"G={g}"))
        print("\nmemory table (again, for copying):")
        memory_table(rows)
        scale_table(f"time per GRPO iteration vs completion length "
                    f"(G={defaults.group_size})", "max_new_tokens",
                    lengths, by_length)
        scale_table(f"time per GRPO iteration vs group size ({defaults.max_new_tokens} new tokens)",
                    "G", groups,
                    by_group)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
