"""The collapse watchdog: each detector on hand-written metric sequences (fires on the failure,
not on noise), its state surviving a checkpoint bit for bit, and fault-injection runs on tiny
models (a reward that flips sign, a reward that pays for length, a reward that pays for one
repeated token at a high learning rate) with the watchdog on and off, the CLI's console lines and
evaluation report included."""

import copy
import importlib
import json
import math
import random
import shutil
import statistics
from pathlib import Path
from statistics import NormalDist
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from slm_align.config import WatchdogSettings
from slm_align.envelope.recovery import WatchedRun, read_events
from slm_align.envelope.run import TrainableRun
from slm_align.envelope.watchdog import (
    Trigger,
    Watchdog,
    confirm_level,
    entropy_collapse,
    kl_runaway,
    mismatch_runaway,
    paired_drop,
    reward_dropped,
    tool_level,
)
from slm_align.envelope.watchdog_text import event_line, published_line, report_section
from slm_align.envelope.world import World
from slm_align.modeling.models import save_adapter
from slm_align.ondevice.rewards.columns import with_columns
from slm_align.ondevice.rewards.protocol import CombinedReward
from slm_align.pipeline import run_rl
from slm_align.rl.grpo import GRPO
from tests.helpers import finished_sft_run, run_cli


def noisy(center: float, spread: float, count: int, seed: int = 0) -> list[float]:
    """``count`` values uniform in center +- spread."""
    generator = random.Random(seed)
    return [center + generator.uniform(-spread, spread) for _ in range(count)]


def feed(watchdog: Watchdog, key: str, values: list[float]):
    """Observe one metric's values, one iteration each; the first trigger and
    the iteration it came at."""
    for i, value in enumerate(values):
        watchdog.observe({key: value})
        trigger = watchdog.check()
        if trigger is not None:
            return trigger, i + 1
    return None, None


# ---- detectors on hand-written sequences ---------------------------------------------------------
@pytest.mark.parametrize("key, healthy, failing, detector", [
    ("entropy", noisy(2.0, 0.3, 30), noisy(2.0, 0.3, 6) + [1.0, 0.6, 0.4, 0.3, 0.2, 0.2, 0.1, 0.1], "entropy_collapse"),
    ("completion/length", noisy(20, 4, 30), noisy(20, 4, 6) + [26, 30, 34, 40, 44, 46, 48, 48], "length_inflation"),
    ("completion/truncated_frac", noisy(0.2, 0.1, 30), noisy(0.2, 0.1, 6) + [0.4, 0.6, 0.8, 0.9, 1.0, 1.0, 1.0],
     "length_inflation"),
    ("kl", noisy(2.0, 1.5, 30), noisy(2.0, 1.0, 6) + [6, 9, 14, 20, 30, 40], "kl_runaway"),
    ("grpo/zero_std_frac", noisy(0.25, 0.25, 30), noisy(0.2, 0.2, 6) + [0.5, 0.75, 1.0, 1.0, 1.0, 1.0],
     "starving_groups"),
    ("sampler/kl", [abs(x) for x in noisy(0.002, 0.002, 30)], noisy(0.002, 0.001, 6) + [0.02, 0.05, 0.09, 0.2, 0.4],
     "sampler_mismatch"),
])
def test_each_windowed_detector_fires_on_its_failure_and_not_on_noise(key, healthy, failing, detector):
    settings = WatchdogSettings(window=3)
    trigger, _ = feed(Watchdog(settings), key, healthy)
    assert trigger is None  # 30 noisy healthy iterations: nothing
    trigger, at = feed(Watchdog(settings), key, failing)
    assert trigger is not None and trigger.detector == detector and at > 6


def test_a_single_outlier_does_not_fire_a_windowed_detector():
    values = [2.0] * 6 + [0.1] + [2.0] * 6  # one iteration with near-zero entropy
    trigger, _ = feed(Watchdog(WatchdogSettings(window=3)), "entropy", values)
    assert trigger is None


def test_detector_thresholds_and_off_switches():
    assert entropy_collapse([2.0, 2.0], [0.5, 0.7], floor=0.3) is None  # 0.6 >= 0.3 x 2.0
    assert entropy_collapse([2.0, 2.0], [0.5, 0.5], floor=0.3).threshold == pytest.approx(0.6)
    assert entropy_collapse([2.0, 2.0], [0.0, 0.0], floor=0.0) is None  # 0: off
    assert kl_runaway([11.0, 12.0], max_kl=10.0).value == 11.5
    assert kl_runaway([11.0, 12.0], max_kl=0.0) is None
    assert mismatch_runaway([0.04, 0.08], max_sampler_kl=0.05).value == pytest.approx(0.06)
    assert mismatch_runaway([0.04, 0.05], max_sampler_kl=0.05) is None  # 0.045: under
    assert mismatch_runaway([1.0, 1.0], max_sampler_kl=0.0) is None  # 0: off


def episode_metrics(count: int, calling: int, calls: int, valid: int) -> dict:
    """One iteration's agent metrics from its counts, as ``episode_stats`` logs them."""
    return {"episode/call_rate": calling / count, "episode/valid_call_rate": valid / calls if calls else float("nan"),
            "episode/count": float(count), "episode/with_calls": float(calling), "episode/calls": float(calls),
            "episode/valid_calls": float(valid), "episode/success": 0.5}


def episodes(calls: list[float], valid: list[float], count: int = 32) -> list[dict]:
    """Per-iteration metrics of ``count`` agent episodes at the given call rates and valid-call
    rates (one call per calling episode; a NaN valid rate: no call validated)."""
    rows = []
    for c, v in zip(calls, valid):
        calling = round(c * count)
        rows.append(episode_metrics(count, calling, calling, round((0.0 if v != v else v) * calling)))
    return rows


def feed_metrics(watchdog: Watchdog, rows: list[dict]):
    """Observe one metrics dict per iteration; the first trigger and the iteration it came at."""
    for i, metrics in enumerate(rows):
        watchdog.observe(metrics)
        trigger = watchdog.check()
        if trigger is not None:
            return trigger, i + 1
    return None, None


def test_tool_use_collapse_fires_when_the_policy_stops_calling_tools():
    calls = noisy(0.6, 0.1, 6, seed=3) + [0.4, 0.3, 0.2, 0.1, 0.05, 0.0, 0.0]
    valid = noisy(0.9, 0.05, 6, seed=4) + [0.9, 0.8, 0.9, 1.0, float("nan"), float("nan"), float("nan")]
    trigger, at = feed_metrics(Watchdog(WatchdogSettings(window=3)), episodes(calls, valid))
    assert trigger.detector == "tool_use_collapse" and at > 6
    assert trigger.value < trigger.threshold and trigger.why.startswith("call rate ")
    assert "< 0.5 x start" in trigger.why


def test_tool_use_collapse_fires_when_calls_stop_parsing():
    calls = noisy(0.6, 0.1, 20, seed=5)  # the policy keeps calling ...
    valid = noisy(0.9, 0.05, 6, seed=6) + [0.7, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1]  # ... malformed calls
    trigger, at = feed_metrics(Watchdog(WatchdogSettings(window=3)), episodes(calls, valid))
    assert trigger.detector == "tool_use_collapse" and trigger.why.startswith("valid-call rate ")
    assert at > 6


def test_tool_use_collapse_ignores_noise_absent_metrics_and_a_policy_that_barely_calls():
    settings = WatchdogSettings(window=3)
    noise = episodes(noisy(0.4, 0.2, 40, seed=7), noisy(0.8, 0.15, 40, seed=8))
    assert feed_metrics(Watchdog(settings), noise) == (None, None)
    single_turn = [{"entropy": e} for e in noisy(2.0, 0.2, 40)]  # no episode metrics: not watched
    assert feed_metrics(Watchdog(settings), single_turn) == (None, None)
    only_valid = [{"episode/valid_call_rate": v} for v in [0.9] * 6 + [0.1] * 6]  # rates, no counts
    assert feed_metrics(Watchdog(settings), only_valid) == (None, None)
    barely = episodes([0.04, 0.02, 0.03] + [0.0] * 10, [1.0] * 3 + [0.0] * 10)  # 3 calls: under 10
    assert feed_metrics(Watchdog(settings), barely) == (None, None)
    falling = episodes([0.6] * 3 + [0.0] * 10, [0.9] * 3 + [0.0] * 10)
    off = settings.model_copy(update=dict(call_rate_floor=0.0, valid_call_floor=0.0))
    assert feed_metrics(Watchdog(off), falling) == (None, None)  # 0: off
    assert feed_metrics(Watchdog(settings), falling)[0].detector == "tool_use_collapse"


def tool_iteration(rng: random.Random, rate: float, valid: float, count: int = 32) -> dict:
    """One iteration of ``count`` simulated episodes: each calls a tool (once) with chance
    ``rate``, and each call validates with chance ``valid``."""
    calling = sum(rng.random() < rate for _ in range(count))
    return episode_metrics(count, calling, calling, sum(rng.random() < valid for _ in range(calling)))


def tool_run(seed: int, rate: float, valid: float, steps: int = 200, after: float = 0.0, at: int = 10 ** 9):
    """The first trigger's (detector, iteration) of a simulated agent run under the default watchdog,
    its call rate ``rate`` up to iteration ``at`` and ``after`` past it; (None, None) if none."""
    rng = random.Random(seed)
    rows = [tool_iteration(rng, rate if i <= at else after, valid) for i in range(1, steps + 1)]
    trigger, when = feed_metrics(Watchdog(WatchdogSettings()), rows)
    return (trigger.detector if trigger else None), when


@pytest.mark.parametrize("rate, valid", [(0.08, 0.9), (0.15, 0.9), (0.3, 0.3)])
def test_a_steady_tool_use_rate_rarely_raises_a_collapse(rate, valid):
    # 32 episodes an iteration, rates that never change: the raw ratios against the first window
    # fired in 73%, 36% and 72% of these 200-iteration runs; the counts' test, 1.5%, 1% and 1%
    fired = [tool_run(seed, rate, valid)[0] for seed in range(200)]
    assert fired.count("tool_use_collapse") / len(fired) < 0.05


def test_a_steady_tool_use_rate_rarely_raises_a_collapse_in_a_long_run():
    fired = [tool_run(seed, 0.08, 0.9, steps=1000)[0] for seed in range(60)]  # raw ratios: 87%
    assert fired.count("tool_use_collapse") / len(fired) < 0.05


def test_a_real_tool_use_collapse_is_still_caught_within_a_window():
    runs = [tool_run(seed, 0.3, 0.9, after=0.05, at=100) for seed in range(100)]
    caught = [at for detector, at in runs if detector == "tool_use_collapse" and at > 100]
    assert len(caught) / len(runs) >= 0.95 and statistics.median(caught) <= 105


def test_tool_levels_spend_alpha_over_the_looks_of_a_run():
    levels = [tool_level(look, 5) for look in range(1, 50_001)]
    assert levels[:5] == [levels[0]] * 5 and levels[5] == pytest.approx(levels[0] / 4)  # blocks of W looks
    assert 2 * sum(levels) < 0.05  # both rates, every look: at most 5%


def test_a_state_written_before_the_tool_use_metrics_were_watched_resumes():
    watchdog = Watchdog(WatchdogSettings(window=2))
    state = watchdog.state_dict()
    for window in ("start", "recent"):
        state[window] = {key: values for key, values in state[window].items()
                         if not key.startswith("episode/")}
    again = Watchdog(WatchdogSettings(window=2))
    again.load_state_dict(state)
    assert feed_metrics(again, episodes([0.6, 0.6, 0.1, 0.1], [0.9] * 4))[0].detector == "tool_use_collapse"


def test_paired_drop_is_mean_and_standard_error_of_the_differences():
    mean, se = paired_drop([1.0, 2.0, 3.0], [0.0, 2.0, 1.0])  # d = 1, 0, 2
    assert mean == pytest.approx(1.0) and se == pytest.approx(1.0 / 3 ** 0.5)
    assert reward_dropped([1.0, 2.0, 3.0], [0.0, 2.0, 1.0], margin=0.0, z=1.5)  # 1.0 > 1.5 x 0.577
    assert not reward_dropped([1.0, 2.0, 3.0], [0.0, 2.0, 1.0], margin=0.0, z=2.0)  # 1.0 < 2 x 0.577
    assert not reward_dropped([1.0, 2.0, 3.0], [0.0, 2.0, 1.0], margin=1.5, z=0.5)


class Reprobes:
    """``reprobe(offset)`` for :meth:`Watchdog.record_probe` on hand-written rewards: the current
    adapter's fresh probe is ``now``; the offsets asked for are kept."""

    def __init__(self, now=None):
        self.now = now
        self.calls = []

    def __call__(self, offset: int) -> list[float]:
        self.calls.append(offset)
        return self.now


def test_reward_drop_needs_patience_probes_in_a_row_confirmed_on_fresh_seeds():
    watchdog = Watchdog(WatchdogSettings(reward_patience=2))
    best = noisy(1.0, 0.2, 16, seed=1)
    reprobe = Reprobes(now=[b - 0.3 if i % 2 else b + 0.25 for i, b in enumerate(best)])  # as the peak did
    assert watchdog.record_probe(0, [0.0] * 16, lambda: "start", reprobe)
    assert watchdog.record_probe(5, best, lambda: "best", reprobe)
    watchdog.record_probe(10, [b - 0.5 for b in best], lambda: "never", reprobe)
    assert watchdog.check() is None  # one probe below: not yet
    within_noise = [b - 0.3 if i % 2 else b + 0.25 for i, b in enumerate(best)]  # mean drop 0.025, se 0.07
    # not a drop: the count starts over; and not the peak, so not kept either
    assert not watchdog.record_probe(15, within_noise, lambda: "later", reprobe)
    watchdog.record_probe(20, [b - 0.5 for b in best], lambda: "never", reprobe)
    assert watchdog.check() is None and reprobe.calls == []
    # two in a row below the peak: confirmed on fresh seeds, where the adapter draws as the peak did
    watchdog.record_probe(25, [b - 0.6 for b in best], lambda: "never", reprobe)
    assert reprobe.calls == [1, 2, 3, 4] and watchdog.check() is None  # the screen's false alarm
    assert watchdog.confirmations == 1 and watchdog.below == 0  # counted, and the count starts over
    reprobe.now = [b - 0.5 for b in best]  # now it really fell
    watchdog.record_probe(30, [b - 0.5 for b in best], lambda: "never", reprobe)
    watchdog.record_probe(35, [b - 0.6 for b in best], lambda: "never", reprobe)
    assert reprobe.calls == list(range(1, 9))  # fresh seeds again
    trigger = watchdog.check()
    assert trigger.detector == "reward_drop" and "peak (iteration 5" in trigger.why
    assert trigger.value == pytest.approx(0.5) and "confirmed on fresh seeds" in trigger.why
    assert watchdog.peak_step == watchdog.best_step == 5 and watchdog.best_state == "best"
    watchdog.respond(35, trigger)
    assert watchdog.check() is None  # the rollback starts over


def test_confirmation_levels_spend_alpha_over_the_run():
    levels = [confirm_level(2.0, j) for j in range(1, 10_001)]
    assert levels[0] == pytest.approx(0.02275 * 6 / math.pi ** 2, rel=1e-3)
    assert sum(levels) < NormalDist().cdf(-2.0)  # all of them together: at most alpha
    assert levels == sorted(levels, reverse=True)


def bernoulli(rate: float):
    """Probe rewards of a policy that succeeds on each prompt with probability ``rate``."""
    return lambda rng: [float(rng.random() < rate) for _ in range(16)]


def gaussian(mean: float):
    """Probe rewards of a policy whose per-prompt rewards are N(mean, 1)."""
    return lambda rng: [rng.gauss(mean, 1.0) for _ in range(16)]


def simulated_watchdog(before, after, seed: int, drop_at: int = 10 ** 9, steps: int = 200):
    """A run of ``steps`` iterations under the default watchdog with no model: healthy entropy each
    iteration, and at each probe (the start, every ``eval_every``, the end) 16 per-prompt rewards
    drawn afresh from ``before`` up to iteration ``drop_at`` and from ``after`` past it; the kept
    adapter is the policy of its iteration, and a fresh-seed probe draws from it afresh. The first
    trigger's detector and iteration, or (None, None), and the watchdog."""
    rng = random.Random(seed)
    watchdog = Watchdog(WatchdogSettings())
    current = {"policy": before}

    def reprobe(offset: int) -> list[float]:
        return current["policy"](rng)

    watchdog.record_probe(0, before(rng), lambda: before, reprobe)
    for done in range(1, steps + 1):
        current["policy"] = before if done <= drop_at else after
        watchdog.observe({"entropy": rng.uniform(1.8, 2.2)})
        if watchdog.probe_due(done, steps):
            policy = current["policy"]
            watchdog.record_probe(done, policy(rng), lambda policy=policy: policy, reprobe)
        trigger = watchdog.check()
        if trigger is not None:
            return trigger.detector, done, watchdog
    return None, None, watchdog


def simulated_run(before, after, seed: int, drop_at: int = 10 ** 9, steps: int = 200):
    """The first trigger's detector and iteration of :func:`simulated_watchdog`, or (None, None)."""
    return simulated_watchdog(before, after, seed, drop_at, steps)[:2]


@pytest.mark.parametrize("policy", [bernoulli(0.4), gaussian(0.0)], ids=["bernoulli-0.4", "gaussian"])
def test_a_policy_that_never_changes_is_rarely_rolled_back_even_in_a_long_run(policy):
    # 201 probes of one unchanging policy over 1,000 iterations: the Bonferroni screen alone
    # rolled back 9.0% and 5.6% of these runs (3.5% at 200 iterations); confirmed on fresh seeds
    # at levels spent over the run, 0.3% and 0%
    fired = [simulated_run(policy, policy, seed, steps=1000)[0] for seed in range(200)]
    assert fired.count("reward_drop") / len(fired) < 0.03
    assert set(fired) <= {None, "reward_drop"}


@pytest.mark.parametrize("after", [bernoulli(0.3), bernoulli(0.2)], ids=["to-0.3", "to-0.2"])
def test_after_a_real_drop_the_adapter_kept_is_from_before_it(after):
    # success 0.5, then worse from iteration 100 of 200: the published (and rollback) adapter was
    # one from after the drop in 92% (to 0.3) and 76% (to 0.2) of these runs when any probe not
    # significantly below the peak took its place
    runs = [simulated_watchdog(bernoulli(0.5), after, seed, drop_at=100)[2] for seed in range(300)]
    post_drop = [w.best_step for w in runs if w.best_step > 100]
    assert len(post_drop) / len(runs) < 0.05
    assert all(w.best_step == w.peak_step for w in runs)


@pytest.mark.parametrize("before, after", [(bernoulli(0.5), bernoulli(0.1)),
                                           (gaussian(0.0), gaussian(-1.0))],
                         ids=["success-0.5-to-0.1", "gaussian-down-1-sd"])
def test_a_real_drop_in_the_middle_of_a_run_is_caught(before, after):
    runs = [simulated_run(before, after, seed, drop_at=100) for seed in range(500)]
    caught = [at for detector, at in runs if detector == "reward_drop" and at > 100]
    assert len(caught) / len(runs) >= 0.9
    assert statistics.median(caught) <= 125  # within five probes of the drop, half the time


def test_the_peak_is_published_a_tie_goes_to_the_trained_adapter_a_lower_probe_never():
    watchdog = Watchdog(WatchdogSettings())
    reprobe = Reprobes()
    start = noisy(0.5, 0.2, 16, seed=2)
    assert watchdog.record_probe(0, start, lambda: "untrained", reprobe)
    assert watchdog.record_probe(5, list(reversed(start)), lambda: "trained", reprobe)  # as good
    assert watchdog.best_step == watchdog.peak_step == 5 and watchdog.best_state == "trained"
    slightly_lower = [value - 0.06 if i % 2 else value + 0.05 for i, value in enumerate(start)]  # within noise
    assert not watchdog.record_probe(10, slightly_lower, lambda: "lower", reprobe)
    assert watchdog.best_step == 5 and watchdog.best_state == "trained" and reprobe.calls == []


def test_respond_rolls_back_until_recoveries_are_spent_then_stops():
    watchdog = Watchdog(WatchdogSettings(window=2, max_recoveries=2, lr_factor=0.5, kl_factor=2.0))
    watchdog.record_probe(0, [1.0], lambda: "best", Reprobes())
    for value in (1.0, 1.0, 20.0, 20.0):
        watchdog.observe({"kl": value})
    trigger = watchdog.check()
    assert trigger.detector == "kl_runaway"
    first = watchdog.respond(4, trigger)
    assert first["action"] == "rollback" and first["lr_scale"] == 0.5 and first["kl_scale"] == 2.0
    assert watchdog.check() is None  # the recent window starts over after a rollback
    second = watchdog.respond(6, trigger)
    third = watchdog.respond(8, trigger)
    assert second["action"] == "rollback" and second["lr_scale"] == 0.25 and second["recoveries"] == 2
    assert third["action"] == "stop" and watchdog.stopped.startswith("kl_runaway")


def test_state_survives_a_checkpoint_bit_for_bit(tmp_path):
    settings = WatchdogSettings(window=3)
    watchdog = Watchdog(settings)
    watchdog.record_probe(0, noisy(0.5, 0.5, 8), lambda: {"w": torch.randn(3, 3)}, Reprobes())
    for value in noisy(2.0, 0.3, 7):
        watchdog.observe({"entropy": value, "kl": value / 3, "completion/length": value * 10})
    torch.save({"watchdog": watchdog.state_dict()}, tmp_path / "c.pt")
    again = Watchdog(settings)
    again.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["watchdog"])
    state = again.state_dict()
    for name, value in watchdog.state_dict().items():
        if name == "best_state":
            assert torch.equal(state[name]["w"], value["w"])
        else:
            assert state[name] == value, name


def test_events_reach_the_report_and_the_curves(tmp_path):
    from slm_align.plots import plot_curves

    event = {"step": 3, "detector": "kl_runaway", "value": 12.5, "threshold": 10.0, "why": "KL 12.5 > 10",
             "action": "rollback", "best_step": 2, "best_reward": 0.5, "recoveries": 1, "lr_scale": 0.5,
             "kl_scale": 2.0, "learning_rate": 5e-4, "kl_coef": 0.1}
    record = {"enabled": True, "published_step": 2, "peak_step": 1, "best_reward": 0.5, "stopped_early": None}
    section = "\n".join(report_section(record, [event]))
    assert "## Watchdog" in section and "| 3 | kl_runaway | 12.5 | 10 | rollback | 0.0005 |" in section
    assert "adapter of iteration 2 (the peak of the held-out probe, mean reward 0.500)" in section
    assert "adapter-last" in section
    off = "\n".join(report_section({"enabled": False, "published_step": 8}, []))
    assert "was off" in off and "the last adapter (iteration 8)" in off
    assert report_section(None, []) == []
    line = event_line(event)
    assert line.startswith("watchdog: kl_runaway at iteration 3 (KL 12.5 > 10); "
                           "rolled back to iteration 2") and "shaping" not in line
    tool = dict(event, detector="tool_use_collapse", value=0.1, threshold=0.3, why="call rate 0.10 < 0.5 x start 0.60",
                kl_scale=1.0, shaping_scale=2.0)
    assert event_line(tool) == ("watchdog: tool_use_collapse at iteration 3 (call rate 0.10 < 0.5 x start "
                                "0.60); rolled back to iteration 2, learning rate x0.5, call-format "
                                "shaping x2 (recovery 1)")
    rows = "\n".join(report_section(record, [event, tool]))
    assert "| 3 | tool_use_collapse | 0.1 | 0.3 | rollback, call-format shaping x2 | 0.0005 |" in rows
    assert "| 3 | kl_runaway | 12.5 | 10 | rollback | 0.0005 |" in rows
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "kl": float(i)}) + "\n" for i in range(1, 6)))
    assert plot_curves(metrics, tmp_path / "curves.png", events=[event]).stat().st_size > 1000


# ---- the tool-use remedy: call-format shaping ----------------------------------------------------
def task_reward(prompts, completions, **_):
    return [0.25 for _ in completions]


def well_formed(prompts, completions, **_):
    return [1.0 for _ in completions]


def shaped_reward() -> CombinedReward:
    """A task term and a call_format shaping term at half weight: 0.25 + 0.5 = 0.75 per completion."""
    return CombinedReward([("task", task_reward, 1.0), ("call_format", well_formed, 0.5)])


def weight_of(reward, name: str) -> float:
    return next(weight for term, _, weight in reward.terms if term == name)


def test_combined_reward_scales_a_term_relative_to_its_weight_at_construction():
    reward = shaped_reward()
    reward.scale_term("call_format", 2.0)
    assert weight_of(reward, "call_format") == 1.0 and weight_of(reward, "task") == 1.0
    reward.scale_term("call_format", 4.0)  # absolute: 4 x 0.5, not 4 x 1.0
    assert weight_of(reward, "call_format") == 2.0 and reward(["p"], ["c"]) == [2.25]
    reward.scale_term("no_such_term", 3.0)
    assert [weight for _, _, weight in reward.terms] == [1.0, 2.0]
    wrapped = with_columns(shaped_reward(), tasks=None)  # the column wrapper passes it on
    wrapped.scale_term("call_format", 2.0)
    assert weight_of(wrapped.reward, "call_format") == 1.0


def test_a_tool_use_rollback_doubles_the_shaping_scale_and_survives_a_checkpoint(tmp_path):
    watchdog = Watchdog(WatchdogSettings(window=2, max_recoveries=3))
    watchdog.record_probe(0, [0.5, 0.6], lambda: "best", Reprobes())
    trigger, _ = feed_metrics(watchdog, episodes([0.6, 0.6, 0.1, 0.1], [0.9] * 4))
    first = watchdog.respond(4, trigger)
    assert first["action"] == "rollback" and first["shaping_scale"] == 2.0 and first["lr_scale"] == 0.5
    assert first["kl_scale"] == 1.0
    kl = watchdog.respond(6, Trigger("kl_runaway", 12.0, 10.0, "KL 12 > 10"))
    assert kl["shaping_scale"] == 2.0 and kl["kl_scale"] == 2.0  # other detectors leave it
    assert watchdog.respond(8, trigger)["shaping_scale"] == 4.0
    assert watchdog.summary()["shaping_scale"] == 4.0
    torch.save({"watchdog": watchdog.state_dict()}, tmp_path / "c.pt")
    again = Watchdog(WatchdogSettings(window=2, max_recoveries=3))
    again.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["watchdog"])
    assert again.state_dict() == watchdog.state_dict() and again.shaping_scale == 4.0


class FakeLearner:
    """What the watchdog's wiring touches on a learner: one trainable tensor and its AdamW,
    the learning rate, PPO's KL coefficient, the reward and the iteration."""

    set_learning_rate = TrainableRun.set_learning_rate  # the real rule: base x the watchdog's scale x warmup

    def __init__(self, reward_fn):
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.named_params = [("w", self.weight)]
        self.optimizer = torch.optim.AdamW([self.weight], lr=1e-3)
        self.learning_rate = 1e-3
        self.lr_scale = 1.0
        self.warmup_steps = 0
        self.settings = SimpleNamespace(algo="ppo", steps=20)
        self.kl_coef = 0.05
        self.reward_fn = reward_fn
        self.step = 0

    def kl_weight(self) -> float:  # as PPO: the coefficient in the learner's state
        return self.kl_coef

    def raise_kl(self, factor: float, base_beta: float, scale: float) -> None:
        self.kl_coef *= factor

    def rescale_kl(self, base_beta: float, scale: float) -> None:
        pass


def test_a_tool_use_collapse_in_a_run_weighs_up_call_format_but_probes_with_base_weights(tmp_path):
    no_columns = SimpleNamespace(columns_for=lambda prompts: {})
    loop = FakeLearner(with_columns(shaped_reward(), tasks=no_columns))
    probes, said = [], []

    def probe(offset: int = 0) -> list[float]:
        probes.append(loop.reward_fn(["p"] * 4, ["c"] * 4))
        return probes[-1]

    watchdog = Watchdog(WatchdogSettings(window=2, eval_every=2))
    run = WatchedRun(watchdog, probe, tmp_path, World(), said.append, 0.0)
    run.begin(loop)
    for metrics in episodes([0.6, 0.6, 0.1, 0.1, 0.6, 0.6], [0.9] * 6):
        loop.step += 1
        run.after_step(loop, metrics)
    (event,) = read_events(tmp_path / "events.jsonl")
    assert (event["detector"], event["step"], event["shaping_scale"]) == ("tool_use_collapse", 4, 2.0)
    assert event["learning_rate"] == pytest.approx(5e-4)
    assert weight_of(loop.reward_fn.reward, "call_format") == 1.0  # training pays twice for format
    assert probes == [[0.75] * 4] * 4  # the probe's yardstick stays at the base weights
    assert said == [event_line(event)] and "call-format shaping x2 (recovery 1)" in said[0]


# ---- fault injection on a tiny model -------------------------------------------------------------
FLIP = {"after": 10 ** 9, "step": 0}
"""The sign-flip fault: iterations from ``after`` on (and the probes after them) pay minus
what they paid before."""


def shared_flip() -> dict:
    """``FLIP`` of this module as the run imports it (``tests.envelope.test_watchdog``), which pytest may
    have imported under another name: the fixture and the reward must share one dict."""
    return importlib.import_module("tests.envelope.test_watchdog").FLIP


def flipping_reward(prompts, completions, **_):
    """Words per completion / 10, negated once the run has passed iteration ``FLIP["after"]``."""
    flip = shared_flip()
    sign = -1.0 if flip["step"] >= flip["after"] else 1.0
    return [sign * len(c.split()) / 10 for c in completions]


def length_reward(prompts, completions, **_):
    """Pays for length: characters / 10."""
    return [len(c) / 10 for c in completions]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("wd") / "run", tiny_models["llama"], stories, steps=2)


@pytest.fixture
def flip_after(monkeypatch):
    """Set the iteration after which ``flipping_reward`` flips; the run's
    iterations tell it where it is."""
    original = GRPO.run_step
    flip = shared_flip()

    def counted(self, step):
        flip["step"] = step
        return original(self, step)

    monkeypatch.setattr(GRPO, "run_step", counted)

    def arm(after: int) -> None:
        flip["after"] = after
        flip["step"] = 0

    yield arm
    flip["after"] = 10 ** 9


def watched_run(sft_run, out, reward, **watchdog):
    """A tiny GRPO run (2 prompts x 4, 8 tokens) under the given watchdog
    settings; its rl/ directory."""
    base, recipe = sft_run
    shutil.copytree(base / "sft", out / "sft")
    rl = dict(algo="grpo", steps=watchdog.pop("steps", 8), save_steps=2, prompts_per_step=2, group_size=4,
              max_new_tokens=watchdog.pop("max_new_tokens", 8), eval_prompts=2, learning_rate=watchdog.pop("lr", 1e-2),
              report_prompts=0, watchdog=recipe.rl.watchdog.model_copy(update=watchdog))
    recipe = recipe.model_copy(update={"rl": recipe.rl.model_copy(update=rl)})
    run_rl(recipe, out, rewards=[reward], force=True)
    return out / "rl"


def manifest_of(stage: Path) -> dict:
    return json.loads((stage / "manifest.json").read_text())


def events_of(stage: Path) -> list[dict]:
    return [json.loads(line) for line in (stage / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def bundled_run(tmp_path_factory, stories):
    """The bundled 2.5M model after one SFT step: it ends completions with
    EOS, so lengths can grow."""
    from slm_align.modeling.models import DEFAULT_MODEL_DIR

    return finished_sft_run(tmp_path_factory.mktemp("wdb") / "run", DEFAULT_MODEL_DIR, stories, steps=1)


def adapter_bytes(directory: Path) -> bytes:
    return (directory / "adapter_model.safetensors").read_bytes()


def learner_state(loop) -> dict:
    """The learner's trainable weights and AdamW state, cloned by the test itself (not
    the watchdog's capture)."""
    return {"params": {name: param.detach().clone() for name, param in loop.named_params},
            "adamw": copy.deepcopy(loop.optimizer.state_dict()["state"])}


def same_state(first: dict, second: dict) -> bool:
    """Whether two :func:`learner_state` are equal tensor for tensor."""
    if first["params"].keys() != second["params"].keys() or first["adamw"].keys() != second["adamw"].keys():
        return False
    params = all(torch.equal(first["params"][name], second["params"][name]) for name in first["params"])
    adamw = all(torch.equal(value, second["adamw"][index][key])
                for index, moments in first["adamw"].items() for key, value in moments.items())
    return params and adamw


@pytest.fixture
def snapshots(monkeypatch, tmp_path):
    """What each GRPO iteration began with (``entering[step]``: state and learning rate) and
    ended with (``after[iterations done]``, and its adapter saved under
    ``adapters/<iterations done>``)."""
    original = GRPO.run_step
    kept = {"entering": {}, "lr": {}, "after": {}, "adapters": tmp_path / "snapshots"}

    def recorded(self, step):
        kept["entering"][step] = learner_state(self)
        kept["lr"][step] = self.optimizer.param_groups[0]["lr"]
        metrics = original(self, step)
        kept["after"][self.step] = learner_state(self)
        save_adapter(self.policy, kept["adapters"] / str(self.step))
        return metrics

    monkeypatch.setattr(GRPO, "run_step", recorded)
    return kept


def metric_of(stage: Path, key: str) -> list[float]:
    """One metric of every iteration in ``metrics.jsonl``."""
    return [json.loads(line)[key] for line in (stage / "metrics.jsonl").read_text().splitlines()]


def assert_watchdog_off(stage: Path, steps: int, last_adapter: Path) -> None:
    """A ``--watchdog off`` run: recorded off in inputs and results, trained every
    iteration, no events and no ``adapter-last``, and the adapter published is the last
    iteration's, byte for byte."""
    manifest = manifest_of(stage)
    assert manifest["metrics"]["watchdog"] == {"enabled": False, "published_step": steps}
    assert manifest["inputs"]["rl"]["watchdog"]["enabled"] is False
    assert manifest["metrics"]["steps"] == steps
    assert not (stage / "events.jsonl").exists() and not (stage / "adapter-last").exists()
    assert adapter_bytes(stage / "adapter") == adapter_bytes(last_adapter)


def test_reward_that_flips_sign_is_a_reward_drop_rolled_back_and_the_best_is_published(sft_run, tmp_path,
                                                                                       flip_after, snapshots):
    flip = "tests.envelope.test_watchdog:flipping_reward"
    flip_after(3)  # iterations 4.. pay for brevity instead of length
    stage = watched_run(sft_run, tmp_path / "on", flip, eval_every=1, window=2, max_recoveries=1)
    events = events_of(stage)
    assert [(e["detector"], e["action"]) for e in events] == [("reward_drop", "rollback"), ("reward_drop", "stop")]
    assert events[0]["learning_rate"] == pytest.approx(5e-3)  # halved after the rollback
    record = manifest_of(stage)["metrics"]["watchdog"]
    best = record["published_step"]
    assert 1 <= best <= 3 and record["stopped_early"].startswith("reward_drop")
    assert manifest_of(stage)["metrics"]["steps"] == events[-1]["step"] < 8  # stopped early
    flip_after(3)
    reference = watched_run(sft_run, tmp_path / "until-best", flip, enabled=False, steps=best)
    assert adapter_bytes(stage / "adapter") == adapter_bytes(reference / "adapter")  # the best, byte for byte
    assert adapter_bytes(stage / "adapter-last") != adapter_bytes(stage / "adapter")
    flip_after(3)
    off = watched_run(sft_run, tmp_path / "off", flip, enabled=False)
    assert_watchdog_off(off, 8, snapshots["adapters"] / "8")
    assert metric_of(off, "reward/mean")[-1] < 0  # published after the collapse: the last adapter


def test_train_from_the_cli_says_each_event_and_the_published_iteration_and_reports_them(sft_run, tmp_path,
                                                                                         flip_after, capsys):
    base, recipe = sft_run
    out = tmp_path / "run"
    shutil.copytree(base / "sft", out / "sft")
    config = tmp_path / "recipe.toml"
    config.write_text(f'[model]\nsource = "{recipe.model.source}"\n[data]\npath = "{recipe.data.path}"\n'
                      "max_length = 96\n[sft]\nmax_steps = 2\nbatch_size = 4\n[rl]\nsave_steps = 2\n"
                      "eval_prompts = 2\n[rl.watchdog]\nwindow = 2\nmax_recoveries = 1\n")
    args = ["train", "--config", config, "--out", out, "--algo", "grpo", "--reward",
            "tests.envelope.test_watchdog:flipping_reward", "--steps", "8", "--prompts-per-step", "2",
            "--group-size", "4",
            "--max-new-tokens", "8", "--rl-lr", "0.01", "--watchdog-every", "1", "--report-prompts", "4", "--force"]
    flip_after(3)  # the sign-flip run of the test above, through the CLI
    code, stdout, err = run_cli(capsys, *args)
    assert code == 0, err
    console = " ".join(stdout.split())  # rich wraps long lines at the terminal's width
    events = events_of(out / "rl")
    assert [(e["detector"], e["action"]) for e in events] == [("reward_drop", "rollback"), ("reward_drop", "stop")]
    for event in events:
        assert event_line(event) in console
    record = manifest_of(out / "rl")["metrics"]["watchdog"]
    best = record["published_step"]
    assert (f"published: the adapter of iteration {best} (the watchdog's best held-out probe); the last, iteration "
            f"{events[-1]['step']}, kept as rl/adapter-last (export --stage rl-last); stopped early on reward_drop"
            in console)
    report = (out / "eval" / "report.md").read_text()
    section = report[report.index("## Watchdog"):]
    assert f"Published: the adapter of iteration {best} " in section and "Stopped early: reward_drop" in section
    for event in events:
        assert f"| {event['step']} | reward_drop | " in section and f" | {event['action']} | " in section
    # --json says it too (the stage is done: its manifest's figures)
    code, stdout, err = run_cli(capsys, *args, "--report-prompts", "0", "--json")
    assert code == 0, err
    assert json.loads(stdout)["metrics"]["watchdog"]["published_step"] == best


def test_published_line_names_the_iteration_with_the_watchdog_on_and_off():
    record = {"enabled": True, "published_step": 5, "stopped_early": None,
              "last": {"step": 9, "heldout_reward": 0.1, "is_published": False}}
    assert published_line(record) == ("published: the adapter of iteration 5 (the watchdog's best "
                                      "held-out probe); the last, iteration 9, "
                                      "kept as rl/adapter-last (export --stage rl-last)")
    record["last"]["is_published"] = True
    assert published_line(record) == "published: the adapter of iteration 5 (the watchdog's best held-out probe)"
    assert published_line({"enabled": False, "published_step": 8}) == ("published: the last "
                                                                        "adapter, iteration 8 (watchdog off)")
    assert published_line(None) is None


def test_a_killed_run_resumes_the_watchdog_state_bit_for_bit(sft_run, tmp_path, flip_after, monkeypatch):
    flip = "tests.envelope.test_watchdog:flipping_reward"
    flip_after(3)
    whole = watched_run(sft_run, tmp_path / "whole", flip, eval_every=1, window=2, max_recoveries=1)
    flip_after(3)
    patched = GRPO.run_step

    def killed_at_seventh(self, step):
        if step == 6:  # after the rollback at iteration 5 and the checkpoint at 6
            raise KeyboardInterrupt
        return patched(self, step)

    monkeypatch.setattr(GRPO, "run_step", killed_at_seventh)
    with pytest.raises(KeyboardInterrupt):
        watched_run(sft_run, tmp_path / "killed", flip, eval_every=1, window=2, max_recoveries=1)
    monkeypatch.setattr(GRPO, "run_step", patched)
    assert (tmp_path / "killed" / "rl.partial" / "checkpoint.pt").is_file()
    resumed = _resume(sft_run, tmp_path / "killed", flip)
    assert adapter_bytes(resumed / "adapter") == adapter_bytes(whole / "adapter")
    assert adapter_bytes(resumed / "adapter-last") == adapter_bytes(whole / "adapter-last")
    assert events_of(resumed) == events_of(whole)
    watch = manifest_of(whole)["metrics"]["watchdog"]
    resumed_watch = manifest_of(resumed)["metrics"]["watchdog"]
    assert resumed_watch["seconds"] > 0 and watch["seconds"] > 0  # its own time, measured per process
    del resumed_watch["seconds"], watch["seconds"]
    assert resumed_watch == watch


def _resume(sft_run, out: Path, reward: str) -> Path:
    """Resume the killed run of the test above with the same settings."""
    _, recipe = sft_run
    rl = dict(algo="grpo", steps=8, save_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=8, eval_prompts=2,
              learning_rate=1e-2, report_prompts=0,
              watchdog=recipe.rl.watchdog.model_copy(update=dict(eval_every=1, window=2, max_recoveries=1)))
    recipe = recipe.model_copy(update={"rl": recipe.rl.model_copy(update=rl)})
    run_rl(recipe, out, rewards=[reward], force=True, resume=True)
    return out / "rl"


INFLATION = dict(window=2, max_kl=0.0, truncated_rise=0.2, length_ratio=1.2, max_new_tokens=128, steps=8)
"""A reward that pays for length on the bundled model: completions grow toward the 128-token budget
(about 75 tokens and none truncated over the first four iterations, 0.62-0.88 truncated from the sixth on)."""


def test_a_reward_that_pays_for_length_is_detected_as_inflation(bundled_run, tmp_path, snapshots):
    stage = watched_run(bundled_run, tmp_path / "on", "tests.envelope.test_watchdog:length_reward", max_recoveries=0,
                        eval_every=3, **INFLATION)
    events = events_of(stage)
    assert [e["detector"] for e in events] == ["length_inflation"] and events[0]["action"] == "stop"
    record = manifest_of(stage)["metrics"]["watchdog"]
    assert record["detectors"] == ["length_inflation"] and record["stopped_early"].startswith("length_inflation")
    assert manifest_of(stage)["metrics"]["steps"] == events[0]["step"] < 8  # stopped early
    published = record["published_step"]
    assert published == record["peak_step"] < events[0]["step"]  # the peak probe, never a flagged iteration
    if published:
        assert adapter_bytes(stage / "adapter") == adapter_bytes(snapshots["adapters"] / str(published))
    else:  # the probe at iteration 3 fell short of the start's: the fresh LoRA (B = 0) is the peak
        weights = load_file(stage / "adapter" / "adapter_model.safetensors")
        assert all(not tensor.any() for name, tensor in weights.items() if "lora_B" in name)
    assert adapter_bytes(stage / "adapter-last") == adapter_bytes(snapshots["adapters"] / str(events[0]["step"]))


def test_the_length_run_with_the_watchdog_off_publishes_the_last_adapter(bundled_run, tmp_path, snapshots):
    stage = watched_run(bundled_run, tmp_path / "off", "tests.envelope.test_watchdog:length_reward", enabled=False,
                        **INFLATION)
    assert_watchdog_off(stage, 8, snapshots["adapters"] / "8")
    truncated = metric_of(stage, "completion/truncated_frac")  # completions ran into the 128-token budget
    assert statistics.fmean(truncated[-2:]) > statistics.fmean(truncated[:2]) + 0.2  # and nothing said so


def token_reward(prompts, completions, **_):
    """Pays for one repeated token: how many times the word "a" occurs in the completion."""
    return [float(completion.split().count("a")) for completion in completions]


COLLAPSE = dict(lr=4e-3, steps=50, window=3, eval_every=8, max_kl=0.0, length_ratio=0.0, truncated_rise=0.0,
                zero_std_rise=0.0)
"""GRPO on the bundled model at 4x its default learning rate, paid for "a": entropy ~0.45 nats at the start,
rising to ~1.4 by iteration 29, then falling to 0.02 by iteration 36 as every one of the 8 tokens becomes "a"
(torch 2.13, transformers 4.57: with the watchdog on, it fires at 36 (rollback to 32) and again at 46 (stop)).
Only entropy and the reward are watched."""


@pytest.mark.slow
def test_a_reward_for_one_repeated_token_collapses_entropy_rolled_back_to_the_best(bundled_run, tmp_path, snapshots):
    stage = watched_run(bundled_run, tmp_path / "on", "tests.envelope.test_watchdog:token_reward", max_recoveries=1,
                        **COLLAPSE)
    events = events_of(stage)
    assert [(e["detector"], e["action"]) for e in events] == [("entropy_collapse", "rollback"),
                                                             ("entropy_collapse", "stop")]
    rollback, stop = events
    best = rollback["best_step"]
    assert rollback["value"] < rollback["threshold"] and 0 < best < rollback["step"] < stop["step"] < COLLAPSE["steps"]
    # the iteration after the event began from the best iteration's weights and AdamW state,
    # exactly, at half the rate
    assert same_state(snapshots["entering"][rollback["step"]], snapshots["after"][best])
    assert not same_state(snapshots["after"][rollback["step"]], snapshots["after"][best])
    assert snapshots["lr"][rollback["step"] - 1] == pytest.approx(COLLAPSE["lr"])
    assert snapshots["lr"][rollback["step"]] == pytest.approx(COLLAPSE["lr"] / 2) == rollback["learning_rate"]
    record = manifest_of(stage)["metrics"]["watchdog"]
    assert record["stopped_early"].startswith("entropy_collapse") and record["recoveries"] == 1
    assert manifest_of(stage)["metrics"]["steps"] == stop["step"]
    published = record["published_step"]
    assert published < stop["step"] and record["last"]["step"] == stop["step"]
    assert adapter_bytes(stage / "adapter") == adapter_bytes(snapshots["adapters"] / str(published))
    assert adapter_bytes(stage / "adapter-last") == adapter_bytes(snapshots["adapters"] / str(stop["step"]))
    rewards = metric_of(stage, "reward/mean")
    assert rewards[-1] > 5 > rewards[0]  # the reward alone did it: most of the 8 tokens became "a"


@pytest.mark.slow
def test_the_repeated_token_run_with_the_watchdog_off_publishes_the_last_adapter(bundled_run, tmp_path, snapshots):
    stage = watched_run(bundled_run, tmp_path / "off", "tests.envelope.test_watchdog:token_reward", enabled=False,
                        **COLLAPSE)
    steps = COLLAPSE["steps"]
    assert_watchdog_off(stage, steps, snapshots["adapters"] / str(steps))
    entropies = metric_of(stage, "entropy")
    windows = [statistics.fmean(entropies[i:i + 3]) for i in range(len(entropies) - 2)]
    assert min(windows) < 0.3 * windows[0]  # the detector's window fell through the floor, and nothing said so

