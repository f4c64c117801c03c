"""The collapse watchdog: the quiet failures of small-model RL detected from metric dicts,
and what to do about them.

Pure: no torch, no model. The RL stage feeds it each iteration's metrics (:meth:`Watchdog.observe`)
and, every ``eval_every`` iterations, the per-prompt rewards of a fixed held-out probe
(:meth:`Watchdog.record_probe`); it answers with a :class:`Trigger` (:meth:`Watchdog.check`) and the
action (:meth:`Watchdog.respond`): roll back to the best probe with a lower learning rate (and, for
KL runaway, a higher KL coefficient; for tool-use collapse, a heavier call-format shaping reward),
or stop early once ``max_recoveries`` are spent. Its whole state is plain numbers and lists
(:meth:`Watchdog.state_dict`), so a resumed run continues bit for bit; the best iteration's weights
travel beside it as an opaque ``payload``.

The detectors compare windows of ``W = window`` iterations: the first window of the run
(its start) and the last ``W`` iterations since the latest rollback, each summarised by its
mean ``m = (1/W) sum_i x_i``. The reward drop compares each probe with the peak probe, at a
threshold corrected for the number of earlier probes the peak was picked from
(:func:`drop_threshold`).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Optional

from slm_align.config import WatchdogSettings
from slm_align.stats import student_t_quantile

CALLS = "episode/call_rate"
"""Share of an iteration's agent episodes in which the policy made at least one tool call."""
VALID_CALLS = "episode/valid_call_rate"
"""Share of an iteration's tool calls that parsed and validated against the tool's schema."""
SAMPLER_KL = "sampler/kl"
"""Per-token KL of the llama.cpp sampler's distribution from the trainer's (logged only with that sampler)."""
WATCHED = ("entropy", "completion/length", "completion/truncated_frac", "kl", "grpo/zero_std_frac",
           CALLS, VALID_CALLS, SAMPLER_KL)
"""The per-iteration metrics the windowed detectors read (a metric an algorithm does
not log is not watched)."""
SHAPING_TERM = "call_format"
"""The reward term that pays for well-formed tool calls: a tool-use-collapse recovery weighs
it up."""
MIN_START_CALL_RATE = 0.05
"""Tool use is watched only when the first window's call rate is above this: below it the policy
barely calls tools, so a fall is no collapse and the valid share of a handful of calls is noise."""


@dataclass(frozen=True)
class Trigger:
    """A detector that fired: its name, the statistic it measured, the bound it
    crossed, and why in words."""

    detector: str
    value: float
    threshold: float
    why: str


def window_mean(values: list[float]) -> float:
    """Mean of a window, m = (1/W) sum_i x_i."""
    return statistics.fmean(values)


def paired_drop(best: list[float], now: list[float]) -> tuple[float, float]:
    """Mean and standard error of the paired drop d_i = best_i - now_i over the probe's prompts.

    Common random numbers (same prompts, same sampling seed) make the pairs comparable: mean = (1/n)
    sum_i d_i, se = sd(d) / sqrt(n) with the sample standard deviation (0 for a single prompt).
    """
    drops = [b - n for b, n in zip(best, now)]
    mean = statistics.fmean(drops)
    if len(drops) < 2:
        return mean, 0.0
    return mean, statistics.stdev(drops) / math.sqrt(len(drops))


def reward_dropped(best: list[float], now: list[float], margin: float, z: float) -> bool:
    """Whether a probe lies below the best: mean drop > margin and mean drop > z * se
    (see :func:`paired_drop`)."""
    mean, se = paired_drop(best, now)
    return mean > margin and mean > z * se


@functools.lru_cache(maxsize=4096)
def drop_threshold(z: float, earlier: int, prompts: int) -> float:
    """The threshold for :func:`reward_dropped` of a probe of n = ``prompts`` prompts compared with
    the peak of k = ``earlier`` probes: t_(n-1)^-1(1 - alpha / k), with alpha = 1 - Phi(z).

    The peak is the highest of k probe means, so for a policy that never changes it is the maximum
    of k noisy draws and the drop from it is biased upward (the winner's curse). The event "the
    probe lies significantly below the peak" lies inside "it lies significantly below one of the k
    earlier probes", so by Bonferroni's inequality a test at level alpha / k keeps its chance at
    most alpha (Dunn 1961, "Multiple comparisons among means", JASA 56:52-64). The statistic
    mean/se of n paired drops follows Student's t with n - 1 degrees of freedom (Student 1908),
    whose tail at alpha / k is far heavier than the normal's for 16 prompts (P(T > 3.3) = 0.0024,
    five times the normal's), hence t's quantile.

    Simulated 200-iteration runs of a policy that never changes (41 probes of 16 prompts,
    Bernoulli(0.4) rewards, default settings): 75% were rolled back when tested against the peak
    at z alone, 2% with this threshold (tests/rl/test_watchdog.py). A single prompt has no
    standard error: any drop above the margin counts, as before.
    """
    tail = NormalDist().cdf(-z) / max(earlier, 1)
    if prompts < 2:
        return -NormalDist().inv_cdf(tail)
    return student_t_quantile(tail, prompts - 1)


def entropy_collapse(start: list[float], recent: list[float], floor: float) -> Optional[Trigger]:
    """Fires when m(recent entropy) < floor * m(start entropy): the policy stopped exploring."""
    bound = floor * window_mean(start)
    value = window_mean(recent)
    if floor and value < bound:
        return Trigger("entropy_collapse", value, bound, f"entropy {value:.3f} < {floor:g} x start "
                       f"{bound / floor:.3f}")
    return None


def length_inflation(start: list[float], recent: list[float], ratio: float) -> Optional[Trigger]:
    """Fires when m(recent length) > ratio * m(start length): completions inflate."""
    bound = ratio * window_mean(start)
    value = window_mean(recent)
    if ratio and value > bound:
        return Trigger("length_inflation", value, bound, f"mean length {value:.1f} > {ratio:g} x start")
    return None


def _risen(start: list[float], recent: list[float], rise: float, detector: str, label: str) -> Optional[Trigger]:
    """Fires when m(recent) > m(start) + rise (``rise`` 0: off); ``label`` names
    the share in the reason."""
    bound = window_mean(start) + rise
    value = window_mean(recent)
    if rise and value > bound:
        return Trigger(detector, value, bound, f"{label} {value:.2f} > start + {rise:g}")
    return None


def truncation_inflation(start: list[float], recent: list[float], rise: float) -> Optional[Trigger]:
    """Fires when m(recent truncated fraction) > m(start truncated fraction) + rise:
    completions hit the budget."""
    return _risen(start, recent, rise, "length_inflation", "truncated fraction")


def kl_runaway(recent: list[float], max_kl: float) -> Optional[Trigger]:
    """Fires when m(recent KL) > max_kl: the policy runs away from the reference."""
    value = window_mean(recent)
    if max_kl and value > max_kl:
        return Trigger("kl_runaway", value, max_kl, f"KL {value:.3f} > {max_kl:g}")
    return None


def mismatch_runaway(recent: list[float], max_sampler_kl: float) -> Optional[Trigger]:
    """Fires when m(recent sampler KL) > max_sampler_kl: the rollouts' engine and the trainer no longer
    sample the same policy, and the truncated correction is weighing more tokens down each iteration."""
    value = window_mean(recent)
    if max_sampler_kl and value > max_sampler_kl:
        return Trigger("sampler_mismatch", value, max_sampler_kl,
                       f"sampler-trainer KL {value:.4f} > {max_sampler_kl:g}")
    return None


def _fallen(start: list[float], recent: list[float], floor: float, label: str) -> Optional[Trigger]:
    """A tool-use collapse when m(recent) < floor * m(start) (``floor`` 0: off); ``label``
    names the rate in the reason."""
    bound = floor * window_mean(start)
    value = window_mean(recent)
    if floor and value < bound:
        why = f"{label} {value:.2f} < {floor:g} x start {bound / floor:.2f}"
        return Trigger("tool_use_collapse", value, bound, why)
    return None


Windows = tuple[list[float], list[float]]
"""A metric's (start, recent) windows."""


def tool_use_collapse(calls: Windows, valid: Windows, call_floor: float,
                      valid_floor: float) -> Optional[Trigger]:
    """Fires when m(recent call rate) < call_floor * m(start call rate) (the policy stopped calling
    tools) or m(recent valid-call rate) < valid_floor * m(start valid-call rate) (its calls stopped
    parsing); ``calls`` and ``valid`` are (start, recent) windows, ``valid``'s empty when not full.
    Only when m(start call rate) > :data:`MIN_START_CALL_RATE`."""
    if window_mean(calls[0]) <= MIN_START_CALL_RATE:
        return None
    trigger = _fallen(*calls, call_floor, "call rate")
    if trigger is None and valid[1]:
        trigger = _fallen(*valid, valid_floor, "valid-call rate")
    return trigger


def starving(start: list[float], recent: list[float], rise: float) -> Optional[Trigger]:
    """Fires when m(recent all-equal share) > m(start all-equal share) + rise:
    GRPO's groups stop teaching."""
    return _risen(start, recent, rise, "starving_groups", "all-equal groups")


class Watchdog:
    """The watchdog's state over one run: windows, the best probe (and its opaque
    payload), recoveries spent."""

    def __init__(self, settings: WatchdogSettings):
        self.settings = settings
        self.start: dict[str, list[float]] = {key: [] for key in WATCHED}
        self.recent: dict[str, list[float]] = {key: [] for key in WATCHED}
        self.best_step: Optional[int] = None
        """The iteration to publish and roll back to: the latest probe not
        significantly below the peak."""
        self.best_state: Any = None
        self.peak_step: Optional[int] = None
        """The probe with the highest mean reward: what a reward drop is measured against."""
        self.best_reward: Optional[float] = None
        self.best_rewards: list[float] = []
        self.below = 0
        self.probes = 0
        """Probes recorded so far: the candidates the peak was picked from."""
        self.recoveries = 0
        self.lr_scale = 1.0
        self.kl_scale = 1.0
        self.shaping_scale = 1.0
        """The weight of the reward's :data:`SHAPING_TERM` relative to its base weight."""
        self.stopped: Optional[str] = None

    def observe(self, metrics: dict) -> None:
        """Add an iteration's metrics to the windows: the first ``W`` values of a metric form its
        start window, later ones the recent window (its last ``W``), which a rollback empties; a
        metric missing from ``metrics`` (or not finite) is skipped."""
        width = self.settings.window
        for key in WATCHED:
            value = metrics.get(key)
            if value is None or not math.isfinite(value):  # not logged, or a rate of nothing (0/0)
                continue
            if len(self.start[key]) < width:
                self.start[key].append(float(value))
                continue
            self.recent[key] = (self.recent[key] + [float(value)])[-width:]

    def probe_due(self, done: int, last: int) -> bool:
        """Whether the probe runs after ``done`` iterations: at the start, every
        ``eval_every``, and at the end."""
        return done % self.settings.eval_every == 0 or done == last

    def record_probe(self, step: int, rewards: list[float], capture) -> bool:
        """Take a probe's per-prompt rewards; True when it becomes the adapter to
        publish (``capture()`` kept).

        A probe with a higher mean than the peak becomes the peak. A probe that does not lie
        significantly below the peak (:func:`reward_dropped` at :func:`drop_threshold`, corrected
        for the probes the peak was picked from) becomes the one to publish, so training is not
        thrown away on probe noise (the start's untrained adapter is not kept over a trained one
        that is as good); one that does lie below it counts toward the reward drop, measured
        against the peak so that a slow slide cannot ratchet it down.
        """
        mean = statistics.fmean(rewards)
        s = self.settings
        earlier = self.probes
        self.probes += 1
        if self.best_reward is None or mean > self.best_reward:
            self.peak_step = step
            self.best_reward = mean
            self.best_rewards = list(rewards)
        elif s.reward_z and reward_dropped(self.best_rewards, rewards, s.reward_margin,
                                           drop_threshold(s.reward_z, earlier, len(rewards))):
            self.below += 1
            return False
        self.best_step = step
        self.best_state = capture()
        self.below = 0
        return True

    def check(self) -> Optional[Trigger]:
        """The first detector that fires, or None: reward drop, then the windowed ones
        (each needs full windows)."""
        s = self.settings
        if self.below >= s.reward_patience:
            return Trigger("reward_drop", float(self.below), float(s.reward_patience),
                           f"held-out reward below the peak (iteration {self.peak_step}, "
                           f"{self.best_reward:.3f}) for {self.below} probes in a row")
        return self.windowed()

    def windowed(self) -> Optional[Trigger]:
        """The first windowed detector that fires (entropy, length, truncation, KL,
        starving groups, sampler mismatch, tool use), or None."""
        s = self.settings
        start = self.start
        recent = self.recent
        checks = (
            ("entropy", entropy_collapse, (s.entropy_floor,)),
            ("completion/length", length_inflation, (s.length_ratio,)),
            ("completion/truncated_frac", truncation_inflation, (s.truncated_rise,)),
            ("kl", None, (s.max_kl,)),
            ("grpo/zero_std_frac", starving, (s.zero_std_rise,)),
        )
        for key, detector, args in checks:
            if len(recent[key]) < s.window:
                continue
            if detector is None:
                trigger = kl_runaway(recent[key], *args)
            else:
                trigger = detector(start[key], recent[key], *args)
            if trigger is not None:
                return trigger
        if len(recent[SAMPLER_KL]) >= s.window:
            trigger = mismatch_runaway(recent[SAMPLER_KL], s.max_sampler_kl)
            if trigger is not None:
                return trigger
        return self._tool_use()

    def _tool_use(self) -> Optional[Trigger]:
        """:func:`tool_use_collapse` once the call-rate windows are full (the valid-call
        rate's counts once its own are)."""
        s = self.settings
        if len(self.recent[CALLS]) < s.window:
            return None
        valid = ([], [])
        if len(self.recent[VALID_CALLS]) >= s.window:
            valid = (self.start[VALID_CALLS], self.recent[VALID_CALLS])
        return tool_use_collapse((self.start[CALLS], self.recent[CALLS]), valid, s.call_rate_floor,
                                 s.valid_call_floor)

    def respond(self, step: int, trigger: Trigger) -> dict:
        """The action on a trigger and its event record: a rollback (learning rate times
        ``lr_factor``, KL coefficient times ``kl_factor`` on KL runaway, the call-format shaping
        term's weight times ``shaping_factor`` on tool-use collapse, recent windows emptied) while
        recoveries remain, else a stop.
        """
        s = self.settings
        action = "stop"
        if self.recoveries < s.max_recoveries:
            action = "rollback"
            self.recoveries += 1
            self.lr_scale *= s.lr_factor
            if trigger.detector == "kl_runaway":
                self.kl_scale *= s.kl_factor
            if trigger.detector == "tool_use_collapse":
                self.shaping_scale *= s.shaping_factor
            self.recent = {key: [] for key in WATCHED}
            self.below = 0
        else:
            self.stopped = f"{trigger.detector}: {trigger.why}"
        return {"step": step, "detector": trigger.detector, "value": trigger.value, "threshold": trigger.threshold,
                "why": trigger.why, "action": action, "best_step": self.best_step, "best_reward": self.best_reward,
                "recoveries": self.recoveries, "lr_scale": self.lr_scale, "kl_scale": self.kl_scale,
                "shaping_scale": self.shaping_scale}

    def summary(self) -> dict:
        """What the manifest records: on, the best probe, recoveries spent, and why
        the run stopped early."""
        return {"enabled": True, "best_step": self.best_step, "peak_step": self.peak_step,
                "best_reward": self.best_reward,
                "recoveries": self.recoveries, "stopped_early": self.stopped, "lr_scale": self.lr_scale,
                "kl_scale": self.kl_scale, "shaping_scale": self.shaping_scale,
                "settings": self.settings.model_dump()}

    def state_dict(self) -> dict:
        """Everything a resumed run needs (plain numbers and lists, and the
        best payload as given)."""
        fields = ("start", "recent", "best_step", "peak_step", "best_reward", "best_rewards", "best_state", "below",
                  "probes", "recoveries", "lr_scale", "kl_scale", "shaping_scale", "stopped")
        return {name: getattr(self, name) for name in fields}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` (a metric watched since it was written starts with
        empty windows)."""
        for name, value in state.items():
            if name in ("start", "recent"):
                value = {**{key: [] for key in WATCHED}, **value}
            setattr(self, name, value)
