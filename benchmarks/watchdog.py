"""The collapse watchdog side by side: a run that collapses, with and without it; and
a healthy run's overhead.

    python benchmarks/watchdog.py --work /tmp/wd               # defaults: bundled model, 16 GRPO
    iterations python benchmarks/watchdog.py --work /tmp/wd --steps 24 --flip-after 6 --skip-healthy
    python benchmarks/watchdog.py --work /tmp/wd --simulate 500   # the detectors' statistics, no model

The collapse is injected: GRPO trains the bundled model on words per completion / 10 (the
objective); the first ``--flip-after`` iterations pay it and every later one pays the opposite (a
reward pipeline gone wrong: the policy unlearns what it learned while every envelope guard stays
green). Both runs start from the same SFT prior with the same seed. Each published adapter is then
scored on held-out prompts by the objective: mean reward with a 95% interval (mean +- 1.96 sd /
sqrt(n)); iterations wasted, the same count on both sides: those trained after the flip (``trained -
flip_after``), which only unlearn; events fired.

The healthy run is the quickstart's RL stage (PPO, 20 iterations, the learned reward model, the
same SFT and reward model for both): events fired (none expected), wall-clock time with the
watchdog on and off, and the watchdog's own time (probes, weights kept and put back; the
manifest's ``watchdog.seconds``) over the rest of the stage in the same run, which noise on a
shared machine does not move.

``--simulate RUNS`` prints the detectors' statistics on simulated runs with fixed seeds (the tests'
simulators, tests/rl/): false rollbacks of a policy that never changes and what a real drop does
to the reward-drop detector and the adapter kept; false alarms of steady tool-call rates and a real
collapse; length inflation when an agent learns to call tools. Each beside the rule it replaced.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

STATE = {"after": 10 ** 9, "step": 0}
"""Where the flipped signal starts, and the iteration the run is at (set by the
patched ``run_step``)."""


def shared_state() -> dict:
    """``STATE`` of this file imported as the module ``watchdog`` (how the reward spec loads it),
    shared with the script that runs as ``__main__``."""
    return importlib.import_module("watchdog").STATE


def objective(prompts, completions, **_):
    """What we want: words per completion / 10."""
    return [len(c.split()) / 10 for c in completions]


def flipping(prompts, completions, **_):
    """The training signal: the objective, negated from iteration ``STATE["after"]`` on."""
    state = shared_state()
    sign = -1.0 if state["step"] >= state["after"] else 1.0
    return [sign * score for score in objective(prompts, completions)]


def patch_iterations() -> None:
    """Tell the reward which iteration the run is at."""
    from slm_align.rl.grpo import GRPO
    from slm_align.rl.ppo import PPO

    state = shared_state()
    for algorithm in (GRPO, PPO):
        original = algorithm.run_step

        def counted(self, step, original=original):
            """The iteration, counted."""
            state["step"] = step
            return original(self, step)

        algorithm.run_step = counted


def rl_recipe(recipe, steps: int, enabled: bool, **rl):
    """``recipe`` with the RL settings of one run and the watchdog on or off."""
    watchdog = recipe.rl.watchdog.model_copy(update={"enabled": enabled})
    settings = recipe.rl.model_copy(update=dict(rl, steps=steps, report_prompts=0, watchdog=watchdog))
    return recipe.model_copy(update={"rl": settings})


def held_out(recipe, run: Path, prompts: int) -> tuple[float, float]:
    """Mean objective of the run's published adapter on held-out prompts, and the
    half-width of its 95% interval."""
    from slm_align.evaluate.stage import evaluate

    report = evaluate(recipe, run, rewards=["watchdog:objective"], prompts=prompts)
    row = report["policies"][-1]
    return row["reward_mean"], 1.96 * row["reward_std"] / math.sqrt(report["prompts"])


def wasted(trained: int, flip_after: int) -> int:
    """Iterations trained after the flip: the training signal pays the opposite of the
    objective in every one."""
    return max(0, trained - flip_after)


def collapsing(work: Path, sft, steps: int, flip_after: int, prompts: int) -> list[dict]:
    """The injected collapse with the watchdog off and on; one row each."""
    from slm_align.pipeline import run_rl

    base, recipe = sft
    rows = []
    for enabled in (False, True):
        out = work / f"collapse-{'on' if enabled else 'off'}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(base / "sft", out / "sft")
        shared_state().update(after=flip_after, step=0)
        run = rl_recipe(recipe, steps, enabled, algo="grpo", prompts_per_step=2, group_size=4, max_new_tokens=32,
                        eval_prompts=16, learning_rate=1e-2)
        started = time.time()
        result = run_rl(run, out, rewards=["watchdog:flipping"], force=True)
        seconds = time.time() - started
        watch = result.metrics["watchdog"]
        published = watch["published_step"]  # watchdog off: the last iteration
        mean, half = held_out(run, out, prompts)
        rows.append({"run": f"collapse, watchdog "
                     f"{'on' if enabled else 'off'}", "published": published,
                     "trained": result.metrics["steps"], "wasted": wasted(result.metrics["steps"], flip_after),
                     "events": watch.get("events", 0), "reward": mean, "ci": half, "seconds": seconds})
    return rows


def healthy(work: Path) -> list[dict]:
    """The quickstart's RL stage with the watchdog off and on, from the
    same SFT and reward model."""
    from slm_align.config import load_recipe
    from slm_align.pipeline import run_rl
    from slm_align.reward_model.stage import run_reward
    from slm_align.sft.stage import run_sft

    recipe = load_recipe(overrides={"sft.max_steps": 150, "sft.batch_size": 16, "reward.max_steps": 100,
                                    "reward.batch_size": 16, "rl.algo": "ppo", "rl.steps": 20})
    quick = work / "quickstart"
    run_sft(recipe, quick, resume=True)  # the quickstart's SFT and reward model (reused when done)
    run_reward(recipe, quick, resume=True)
    rows = []
    for enabled in (False, True):
        out = work / f"healthy-{'on' if enabled else 'off'}"
        shutil.rmtree(out, ignore_errors=True)
        for stage in ("sft", "reward"):
            shutil.copytree(quick / stage, out / stage)
        run = rl_recipe(recipe, 20, enabled)
        started = time.time()
        result = run_rl(run, out, force=True)
        watch = result.metrics["watchdog"]
        manifest = json.loads((out / "rl" / "manifest.json").read_text())
        rows.append({"run": f"quickstart PPO, watchdog "
                     f"{'on' if enabled else 'off'}", "events": watch.get("events", 0),
                     "published": watch["published_step"],
                     "reward": result.metrics["heldout_reward_rl"], "seconds": time.time() - started,
                     "stage_seconds": manifest["seconds"], "watchdog_seconds": watch.get("seconds", 0.0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="Scratch directory (runs are written here).")
    parser.add_argument("--steps", type=int, default=16, help="GRPO iterations of the collapsing run.")
    parser.add_argument("--flip-after", type=int, default=6, help="Iterations paying the "
                        "objective; every later one pays the opposite (6: iterations 1-6 pay "
                        "it, 7 on are flipped).")
    parser.add_argument("--prompts", type=int, default=64, help="Held-out prompts scoring "
                                                                "each published adapter.")
    parser.add_argument("--skip-healthy", action="store_true", help="Only the collapsing run.")
    parser.add_argument("--simulate", type=int, metavar="RUNS", help="Only the detectors' simulations, "
                        "RUNS runs per row, no model: false alarms and power before and after issue 45.")
    args = parser.parse_args()
    if args.simulate:
        simulate(args.simulate)
        return
    from slm_align.modeling.models import DEFAULT_MODEL_DIR
    from tests.helpers import finished_sft_run

    patch_iterations()
    args.work.mkdir(parents=True, exist_ok=True)
    stories = args.work / "stories.txt"
    sft = finished_sft_run(args.work / "sft-run", DEFAULT_MODEL_DIR, _demo_corpus(stories), steps=20)
    rows = collapsing(args.work, sft, args.steps, args.flip_after, args.prompts)
    print(f"signal flipped after iteration {args.flip_after}; wasted = iterations "
          "trained after the flip")
    print("| run | published iteration | trained | wasted | events | held-out "
          "objective [95% CI] | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['published']} | {r['trained']} | {r['wasted']} | {r['events']} | "
              f"{r['reward']:.3f} [{r['reward'] - r['ci']:.3f}, {r['reward'] + r['ci']:.3f}] | "
              f"{r['seconds']:.0f} |")
    if args.skip_healthy:
        return
    rows = healthy(args.work)
    print("\n| run | events | published iteration | held-out reward | seconds |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['events']} | {r['published']} | {r['reward']:.3f} | "
              f"{r['seconds']:.1f} |")
    overhead = rows[1]["seconds"] / rows[0]["seconds"] - 1
    share = rows[1]["watchdog_seconds"] / (rows[1]["stage_seconds"] - rows[1]["watchdog_seconds"])
    print(f"\nwatchdog time overhead on the healthy run: {overhead:+.1%} wall clock (two runs, "
          f"noisy on a shared machine); {share:.1%} measured inside the watchdog run "
          f"({rows[1]['watchdog_seconds']:.1f} s of probes and kept weights in a "
          f"{rows[1]['stage_seconds']:.1f} s stage)")
    print(json.dumps({"overhead": overhead, "in_run_share": share}))


# ---- simulations: the detectors' statistics, no model (--simulate) ---------------------------------
def screen_only_run(before, after, seed: int, drop_at: int, steps: int) -> tuple[bool, int]:
    """The anchor: the watchdog before issue 45 on the runs of :func:`simulated_watchdog`: the
    Bonferroni screen fires by itself after ``reward_patience`` probes, and the adapter kept is the
    latest probe not significantly below the peak. (fired, the kept iteration)."""
    from slm_align.config import WatchdogSettings
    from slm_align.envelope.watchdog import drop_threshold, reward_dropped

    rng = random.Random(seed)
    s = WatchdogSettings()
    peak, kept, below = None, 0, 0
    for probes, done in enumerate(range(0, steps + 1, s.eval_every)):
        for _ in range(s.eval_every if done else 0):
            rng.uniform(1.8, 2.2)  # the simulated entropy of the iterations since the last probe
        rewards = (before if done <= drop_at else after)(rng)
        if peak is None or statistics.fmean(rewards) > statistics.fmean(peak):
            peak, kept, below = rewards, done, 0
        elif reward_dropped(peak, rewards, s.reward_margin, drop_threshold(s.reward_z, probes, len(rewards))):
            below += 1
            if below >= s.reward_patience:
                return True, kept
            continue
        else:
            kept, below = done, 0
    return False, kept


def reward_table(runs: int) -> list[str]:
    """False rollbacks of a steady policy and what a real drop does, before and after."""
    from tests.envelope.test_watchdog import bernoulli, gaussian, simulated_watchdog

    lines = ["| reward probes (16 prompts) | before: screen alone, latest not below | after: peak, confirmed |",
             "|---|---|---|"]
    for name, policy in (("Bernoulli(0.4)", bernoulli(0.4)), ("N(0, 1)", gaussian(0.0))):
        for steps in (200, 500, 1000):
            old = sum(screen_only_run(policy, policy, seed, 10 ** 9, steps)[0] for seed in range(runs)) / runs
            new = sum(simulated_watchdog(policy, policy, seed, steps=steps)[0] is not None
                      for seed in range(runs)) / runs
            lines.append(f"| {name}, never changes, {steps} iterations: false rollbacks | {old:.1%} | {new:.1%} |")
    drops = (("0.5 -> 0.1", bernoulli(0.5), bernoulli(0.1)), ("0.5 -> 0.2", bernoulli(0.5), bernoulli(0.2)),
             ("0.5 -> 0.3", bernoulli(0.5), bernoulli(0.3)), ("N(0,1) -> N(-1,1)", gaussian(0.0), gaussian(-1.0)))
    for name, before, after in drops:
        old = [screen_only_run(before, after, seed, 100, 200) for seed in range(runs)]
        new = [simulated_watchdog(before, after, seed, drop_at=100) for seed in range(runs)]
        lines.append(f"| drop {name} at iteration 100 of 200: caught | {sum(f for f, _ in old) / runs:.1%} | "
                     f"{sum(d == 'reward_drop' and at > 100 for d, at, _ in new) / runs:.1%} |")
        lines.append(f"| drop {name}: adapter kept is a post-drop one | {sum(k > 100 for _, k in old) / runs:.1%} | "
                     f"{sum(w.best_step > 100 for _, _, w in new) / runs:.1%} |")
    return lines


def raw_ratio_fired(rows: list[dict], window: int = 5, floor: float = 0.5) -> bool:
    """The anchor: the tool-use detector before issue 45, the window means of the raw rates against
    the first window's (watched when that call rate is above 0.05)."""
    keys = ("episode/call_rate", "episode/valid_call_rate")
    start = {key: [] for key in keys}
    recent = {key: [] for key in keys}
    for row in rows:
        for key in keys:
            if row[key] == row[key]:  # NaN: no call to rate
                (start if len(start[key]) < window else recent)[key].append(row[key])
                recent[key] = recent[key][-window:]
        if len(recent[keys[0]]) < window or statistics.fmean(start[keys[0]]) <= 0.05:
            continue
        if any(len(recent[key]) >= window and statistics.fmean(recent[key]) < floor * statistics.fmean(start[key])
               for key in keys):
            return True
    return False


def tool_table(runs: int) -> list[str]:
    """False alarms on steady call rates and a real collapse, before and after (32 episodes an iteration)."""
    from slm_align.config import WatchdogSettings
    from slm_align.envelope.watchdog import Watchdog
    from tests.envelope.test_watchdog import feed_metrics, tool_iteration

    lines = ["| tool use (32 episodes an iteration) | before: raw rates | after: counts' test |", "|---|---|---|"]
    cases = [(rate, valid, steps, rate, 10 ** 9) for steps in (200, 1000)
             for rate, valid in ((0.08, 0.9), (0.15, 0.9), (0.3, 0.3))]
    cases += [(0.3, 0.9, 200, 0.05, 100), (0.15, 0.9, 200, 0.02, 100)]
    for rate, valid, steps, after, at in cases:
        old = new = 0
        for seed in range(runs):
            rng = random.Random(seed)
            rows = [tool_iteration(rng, rate if i <= at else after, valid) for i in range(1, steps + 1)]
            old += raw_ratio_fired(rows)
            trigger, when = feed_metrics(Watchdog(WatchdogSettings()), rows)
            new += trigger is not None and (at > steps or when > at)
        label = (f"steady {rate} ({valid:.0%} valid), {steps} iterations: false alarms" if at > steps else
                 f"collapse {rate} -> {after} at iteration {at}: caught")
        lines.append(f"| {label} | {old / runs:.1%} | {new / runs:.1%} |")
    return lines


def length_table(runs: int) -> list[str]:
    """Length inflation fired when the call rate rises 0.3 -> 0.8 (and when rounds really grow)."""
    from slm_align.config import WatchdogSettings
    from slm_align.envelope.watchdog import Watchdog
    from tests.rollouts.test_episode_lengths import episode_of, rollout_of, trace_of

    rises = [0.3] * 10 + [0.3 + 0.5 * i / 20 for i in range(1, 21)] + [0.8] * 10
    lines = ["| completion/length of episodes | whole sequence (before) | sampled ids | sampled per round (after) |",
             "|---|---|---|---|"]
    for label, rates, scales in (("call rate 0.3 -> 0.8", rises, [1.0] * 40),
                                 ("rounds 1x -> 2x as long", [0.3] * 40, [1.0] * 10 + [1 + i / 10 for i in range(1, 21)]
                                  + [2.0] * 10)):
        fired = {"whole": 0, "sampled": 0, "round": 0}
        for seed in range(runs):
            for kind in fired:
                rng = random.Random(seed)
                watchdog = Watchdog(WatchdogSettings())
                for rate, scale in zip(rates, scales):
                    batch = rollout_of([episode_of(trace_of(rng, rate, scale)) for _ in range(32)])
                    value = {"whole": batch.lengths.float(), "sampled": batch.mask.sum(-1),
                             "round": batch.round_lengths}[kind]
                    watchdog.observe({"completion/length": float(value.mean())})
                    if watchdog.check() is not None:
                        fired[kind] += 1
                        break
        lines.append(f"| {label}: length inflation fired | {fired['whole'] / runs:.0%} | "
                     f"{fired['sampled'] / runs:.0%} | {fired['round'] / runs:.0%} |")
    return lines


def simulate(runs: int) -> None:
    """Print the simulation tables (fixed seeds 0 .. runs - 1)."""
    for table in (reward_table(runs), tool_table(runs), length_table(max(runs // 5, 20))):
        print("\n".join(table) + "\n")


def _demo_corpus(path: Path) -> Path:
    """The demo stories as a text corpus."""
    from slm_align.data.demo_corpus import write_demo_corpus

    return write_demo_corpus(path, n=400, seed=0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers
    main()
