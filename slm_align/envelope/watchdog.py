"""The collapse watchdog: the quiet failures of small-model RL detected from metric dicts,
and what to do about them.

Pure: no torch, no model. The RL stage feeds it each iteration's metrics (:meth:`Watchdog.observe`)
and, every ``eval_every`` iterations, the per-prompt rewards of a fixed held-out probe
(:meth:`Watchdog.record_probe`); it answers with a :class:`Trigger` (:meth:`Watchdog.check`) and the
action (:meth:`Watchdog.respond`): roll back to the peak probe with a lower learning rate (and, for
KL runaway, a higher KL coefficient; for tool-use collapse, a heavier call-format shaping reward),
or stop early once ``max_recoveries`` are spent. Its whole state is plain numbers and lists
(:meth:`Watchdog.state_dict`), so a resumed run continues bit for bit; the best iteration's weights
travel beside it as an opaque ``payload``.

The detectors compare windows of ``W = window`` iterations: the first window of the run
(its start) and the last ``W`` iterations since the latest rollback, each summarised by its
mean ``m = (1/W) sum_i x_i`` (tool use: by its summed counts). The reward drop compares each probe
with the peak probe, at a threshold corrected for the number of earlier probes the peak was picked
from (:func:`drop_threshold`); ``reward_patience`` probes in a row below it are then confirmed by
probing the current adapter on fresh seeds, at a level spent across the run's confirmations
(:func:`confirm_level`). The adapter published and rolled back to is the peak's, never one merely
not significantly below it.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Optional

from slm_align.config import WatchdogSettings
from slm_align.stats import spending_weight, student_t_quantile, two_proportion_z

CALLS = "episode/call_rate"
"""Share of an iteration's agent episodes in which the policy made at least one tool call."""
VALID_CALLS = "episode/valid_call_rate"
"""Share of an iteration's tool calls that parsed and validated against the tool's schema."""
EPISODES = "episode/count"
"""An iteration's agent episodes: the trials of :data:`CALLS`."""
CALLING = "episode/with_calls"
"""An iteration's episodes with at least one tool call: the successes of :data:`CALLS`."""
CALLS_MADE = "episode/calls"
"""An iteration's tool calls: the trials of :data:`VALID_CALLS`."""
VALID_MADE = "episode/valid_calls"
"""An iteration's tool calls that parsed, validated and ran: the successes of :data:`VALID_CALLS`."""
COUNTS = (EPISODES, CALLING, CALLS_MADE, VALID_MADE)
SAMPLER_KL = "sampler/kl"
"""Per-token KL of the llama.cpp sampler's distribution from the trainer's (logged only with that sampler)."""
WATCHED = ("entropy", "completion/length", "completion/truncated_frac", "kl", "grpo/zero_std_frac",
           CALLS, VALID_CALLS, SAMPLER_KL) + COUNTS
"""The per-iteration metrics the windowed detectors read (a metric an algorithm does
not log is not watched)."""
SHAPING_TERM = "call_format"
"""The reward term that pays for well-formed tool calls: a tool-use-collapse recovery weighs
it up."""
MIN_START_CALLS = 10
"""Tool use is watched only when the first window holds at least this many successes (episodes
that called, calls that validated): below it the policy barely calls tools, so a fall is no
collapse, and the normal approximation of :func:`two_proportion_z` is poor."""
TOOL_ALPHA = 0.05
"""The chance that the tool-use detector ever fires on a run whose rates never change, at most
(half for the call rate, half for the valid share; spent over the looks, :func:`tool_level`)."""
CONFIRM_DRAWS = 4
"""Fresh-seed probes of the current adapter at each confirmation of a reward drop, averaged per
prompt: a drop from 0.5 to 0.1 at 16 prompts was confirmed in 92% of simulated runs with two, 93%
with four; N(0, 1) to N(-1, 1), 86% and 91% (tests/envelope/test_watchdog.py's runs). Confirmations are
rare, so their cost is too."""


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
    count = len(drops)
    mean = math.fsum(drops) / count
    if count < 2:
        return mean, 0.0
    variance = math.fsum((d - mean) ** 2 for d in drops) / (count - 1)  # statistics.stdev, 50x faster
    return mean, math.sqrt(variance / count)


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
    Bernoulli(0.4) rewards, default settings): 75% were flagged when tested against the peak at z
    alone, 4% with this threshold. Its chance still grows with the looks (9% at 1,000 iterations),
    which is why a flag is only a screen: :meth:`Watchdog.record_probe` confirms it on fresh seeds
    before anything fires. A single prompt has no standard error: any drop above the margin counts.
    """
    return t_bound(NormalDist().cdf(-z) / max(earlier, 1), prompts)


@functools.lru_cache(maxsize=4096)
def t_bound(tail: float, prompts: int) -> float:
    """The one-sided critical value of the paired t statistic of n = ``prompts`` pairs at level
    ``tail``: Student's t_(n-1)^-1(1 - tail), the normal's for a single pair."""
    if prompts < 2:
        return -NormalDist().inv_cdf(tail)
    return student_t_quantile(tail, prompts - 1)


def confirm_level(z: float, confirmation: int) -> float:
    """The share of the reward drop's level spent on the run's ``confirmation``-th (1, 2, ...)
    confirmation: alpha_j = alpha * 6 / (pi^2 j^2) with alpha = 1 - Phi(z)
    (:func:`~slm_align.stats.spending_weight`); the test divides it by the k probes the peak was
    picked from.

    A confirmation compares the peak's probe with fresh-seed probes of the current adapter: draws
    that did not raise the flag, so on a policy that never changes the only bias left is the
    peak's, the highest of k probes, and by Bonferroni's inequality over those k the j-th
    confirmation fires with chance at most alpha_j; over the run, at most sum_j alpha_j = alpha,
    however many iterations it runs (alpha 2.3% at the default z = 2). Spending over confirmations
    rather than over probes keeps the power: confirmations are rare on a steady run (a flag is,
    :func:`drop_threshold`), so the first ones, at 61% and 15% of alpha, are those that meet a
    real drop.
    """
    return NormalDist().cdf(-z) * spending_weight(confirmation)


def per_prompt_means(draws: list[list[float]]) -> list[float]:
    """The mean reward of each prompt over several probes of it: (k, n) -> (n,)."""
    return [statistics.fmean(column) for column in zip(*draws)]


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


Counts = tuple[float, float]
"""(successes, trials) summed over a window: episodes that called of all episodes, or calls that
validated of all calls."""


def tool_level(look: int, window: int) -> float:
    """The one-sided level of each rate's test at the run's ``look``-th look (1, 2, ...):
    (:data:`TOOL_ALPHA` / 2) * w_b / W, with b = ceil(look / W) and w_b = 6 / (pi^2 b^2)
    (:func:`~slm_align.stats.spending_weight`).

    A look comes every iteration, and consecutive looks share W - 1 of their W iterations; so the
    looks go in blocks of W, Bonferroni's inequality splits a block's share evenly among its W
    looks, and the blocks spend alpha as an open-ended sequence. Summed over every look of a run of
    any length and both rates, at most :data:`TOOL_ALPHA`.
    """
    block = -(-look // window)
    return TOOL_ALPHA / 2 * spending_weight(block) / window


def rate_fell(start: Counts, recent: Counts, floor: float, level: float, label: str) -> Optional[Trigger]:
    """A tool-use collapse when the recent window's rate p_r = x_r / n_r lies below ``floor`` times
    the start's p_s = x_s / n_s (the size of fall that matters) and the pooled two-proportion test
    of p_s > p_r is significant at ``level`` (z > Phi^-1(1 - level),
    :func:`~slm_align.stats.two_proportion_z`); only with at least :data:`MIN_START_CALLS`
    successes in the start window. ``floor`` 0: off; ``label`` names the rate in the reason.

    Rates compared raw, without the test, fired on 73% of simulated 200-iteration runs of a policy
    that calls in 8% of 32 episodes an iteration and never changes (tests/envelope/test_watchdog.py).
    """
    (x_s, n_s), (x_r, n_r) = start, recent
    if not floor or x_s < MIN_START_CALLS or n_r <= 0:
        return None
    p_s = x_s / n_s
    p_r = x_r / n_r
    bound = floor * p_s
    z = two_proportion_z(round(x_s), round(n_s), round(x_r), round(n_r))
    critical = -NormalDist().inv_cdf(level)
    if p_r < bound and z > critical:
        why = (f"{label} {p_r:.2f} < {floor:g} x start {p_s:.2f} ({x_r:g} of {n_r:g} against "
               f"{x_s:g} of {n_s:g}: z {z:.1f} > {critical:.1f})")
        return Trigger("tool_use_collapse", p_r, bound, why)
    return None


def tool_use_collapse(calls: tuple[Counts, Counts], valid: tuple[Counts, Counts], call_floor: float,
                      valid_floor: float, level: float) -> Optional[Trigger]:
    """Fires when the share of episodes that call a tool fell (the policy stopped calling) or the
    share of calls that validate did (its calls stopped parsing), each by :func:`rate_fell` at
    ``level``; ``calls`` and ``valid`` are (start, recent) window counts."""
    trigger = rate_fell(*calls, call_floor, level, "call rate")
    if trigger is None:
        trigger = rate_fell(*valid, valid_floor, level, "valid-call rate")
    return trigger


def starving(start: list[float], recent: list[float], rise: float) -> Optional[Trigger]:
    """Fires when m(recent all-equal share) > m(start all-equal share) + rise:
    GRPO's groups stop teaching."""
    return _risen(start, recent, rise, "starving_groups", "all-equal groups")


class Watchdog:
    """The watchdog's state over one run: windows, the peak probe (and its opaque
    payload), recoveries spent."""

    def __init__(self, settings: WatchdogSettings):
        self.settings = settings
        self.start: dict[str, list[float]] = {key: [] for key in WATCHED}
        self.recent: dict[str, list[float]] = {key: [] for key in WATCHED}
        self.best_step: Optional[int] = None
        """The iteration to publish and roll back to: the peak probe's."""
        self.best_state: Any = None
        self.peak_step: Optional[int] = None
        """The probe with the highest mean reward: what a reward drop is measured against (the
        same iteration as ``best_step``; both kept for the records that name them)."""
        self.best_reward: Optional[float] = None
        self.best_rewards: list[float] = []
        self.below = 0
        self.probes = 0
        """Probes recorded so far: the candidates the peak was picked from."""
        self.confirmations = 0
        """Reward drops put to the fresh-seed test so far (:func:`confirm_level`)."""
        self.fresh = 0
        """Fresh probe seeds used so far: seed offsets 1 .. ``fresh`` are spent."""
        self.dropped: Optional[dict] = None
        """A confirmed reward drop waiting for :meth:`check`: its figures."""
        self.tool_looks = 0
        """Iterations the tool-use detector looked at (full windows), over the whole run."""
        self.recoveries = 0
        self.lr_scale = 1.0
        self.kl_scale = 1.0
        self.shaping_scale = 1.0
        """The weight of the reward's :data:`SHAPING_TERM` relative to its base weight."""
        self.stopped: Optional[str] = None

    def observe(self, metrics: dict) -> None:
        """Add an iteration's metrics to the windows: the first ``W`` values of a metric form its
        start window, later ones the recent window (its last ``W``), which a rollback empties; a
        metric missing from ``metrics`` (or not finite) is skipped. An iteration with full tool-use
        windows is one more look of that detector."""
        width = self.settings.window
        for key in WATCHED:
            value = metrics.get(key)
            if value is None or not math.isfinite(value):  # not logged, or a rate of nothing (0/0)
                continue
            if len(self.start[key]) < width:
                self.start[key].append(float(value))
                continue
            self.recent[key] = (self.recent[key] + [float(value)])[-width:]
        if self._tool_windows_full():
            self.tool_looks += 1

    def probe_due(self, done: int, last: int) -> bool:
        """Whether the probe runs after ``done`` iterations: at the start, every
        ``eval_every``, and at the end."""
        return done % self.settings.eval_every == 0 or done == last

    def record_probe(self, step: int, rewards: list[float], capture, reprobe) -> bool:
        """Take a probe's per-prompt rewards; True when it becomes the peak, the adapter to publish
        and roll back to (``capture()`` kept).

        A probe whose mean is at least the peak's becomes the peak. One that lies significantly
        below the peak (:func:`reward_dropped` at :func:`drop_threshold`, corrected for the probes
        the peak was picked from) counts toward a reward drop; ``reward_patience`` of them in a row
        are confirmed (:meth:`_confirm`) with ``reprobe(offset)``: the current adapter's per-prompt
        rewards on the probe's prompts with the fresh seed ``offset`` (1, 2, ...). A probe not above
        the peak is kept for nothing: a run that slides down by steps too small to test never
        publishes the slide.
        """
        mean = statistics.fmean(rewards)
        s = self.settings
        earlier = self.probes
        self.probes += 1
        if self.best_reward is None or mean >= self.best_reward:
            self.peak_step = self.best_step = step
            self.best_reward = mean
            self.best_rewards = list(rewards)
            self.best_state = capture()
            self.below = 0
            return True
        threshold = drop_threshold(s.reward_z, earlier, len(rewards)) if s.reward_z else 0.0
        if s.reward_z and reward_dropped(self.best_rewards, rewards, s.reward_margin, threshold):
            self.below += 1
        else:
            self.below = 0
        if self.below >= s.reward_patience:
            self.below = 0
            self._confirm(reprobe, earlier)
        return False

    def _confirm(self, reprobe, earlier: int) -> None:
        """Probe the current adapter with :data:`CONFIRM_DRAWS` fresh seeds and keep the drop in
        ``dropped`` when the paired drop of the peak's rewards to their per-prompt means exceeds
        the margin and t_(n-1)^-1(1 - alpha_j / k) standard errors: the peak corrected for the k =
        ``earlier`` probes it was picked from, as the screen is (:func:`drop_threshold`), and
        alpha_j spent over the run's confirmations (:func:`confirm_level`)."""
        s = self.settings
        self.confirmations += 1
        offsets = range(self.fresh + 1, self.fresh + CONFIRM_DRAWS + 1)
        self.fresh += CONFIRM_DRAWS
        now = per_prompt_means([reprobe(offset) for offset in offsets])
        level = confirm_level(s.reward_z, self.confirmations) / max(earlier, 1)
        mean, se = paired_drop(self.best_rewards, now)
        bound = t_bound(level, len(now)) * se
        if mean > s.reward_margin and mean > bound:
            self.dropped = {"drop": mean, "bound": max(bound, s.reward_margin), "now": statistics.fmean(now),
                            "level": level}

    def check(self) -> Optional[Trigger]:
        """The first detector that fires, or None: a confirmed reward drop, then the windowed ones
        (each needs full windows)."""
        drop = self.dropped
        if drop is not None:
            return Trigger("reward_drop", drop["drop"], drop["bound"],
                           f"held-out reward below the peak (iteration {self.peak_step}, "
                           f"{self.best_reward:.3f}) for {self.settings.reward_patience} probes in a "
                           f"row, confirmed on fresh seeds ({drop['now']:.3f}, one-sided level "
                           f"{drop['level']:.2g})")
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

    def _tool_windows_full(self) -> bool:
        """Whether the episode counts fill a start and a recent window."""
        return all(len(self.recent[key]) >= self.settings.window for key in COUNTS)

    def _counts(self, successes: str, trials: str) -> tuple[Counts, Counts]:
        """(start, recent) window sums of a rate's successes and trials."""
        return ((sum(self.start[successes]), sum(self.start[trials])),
                (sum(self.recent[successes]), sum(self.recent[trials])))

    def _tool_use(self) -> Optional[Trigger]:
        """:func:`tool_use_collapse` on the window counts, at this look's :func:`tool_level`."""
        s = self.settings
        if not self._tool_windows_full() or self.tool_looks < 1:
            return None
        return tool_use_collapse(self._counts(CALLING, EPISODES), self._counts(VALID_MADE, CALLS_MADE),
                                 s.call_rate_floor, s.valid_call_floor, tool_level(self.tool_looks, s.window))

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
            self.dropped = None
        else:
            self.stopped = f"{trigger.detector}: {trigger.why}"
        return {"step": step, "detector": trigger.detector, "value": trigger.value, "threshold": trigger.threshold,
                "why": trigger.why, "action": action, "best_step": self.best_step, "best_reward": self.best_reward,
                "recoveries": self.recoveries, "lr_scale": self.lr_scale, "kl_scale": self.kl_scale,
                "shaping_scale": self.shaping_scale}

    def summary(self) -> dict:
        """What the manifest records: on, the peak probe, recoveries spent, and why
        the run stopped early."""
        return {"enabled": True, "best_step": self.best_step, "peak_step": self.peak_step,
                "best_reward": self.best_reward, "confirmations": self.confirmations,
                "recoveries": self.recoveries, "stopped_early": self.stopped, "lr_scale": self.lr_scale,
                "kl_scale": self.kl_scale, "shaping_scale": self.shaping_scale,
                "settings": self.settings.model_dump()}

    def state_dict(self) -> dict:
        """Everything a resumed run needs (plain numbers and lists, and the
        best payload as given)."""
        fields = ("start", "recent", "best_step", "peak_step", "best_reward", "best_rewards", "best_state", "below",
                  "probes", "confirmations", "fresh", "dropped", "tool_looks", "recoveries", "lr_scale",
                  "kl_scale", "shaping_scale", "stopped")
        return {name: getattr(self, name) for name in fields}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` (a metric watched since it was written starts with
        empty windows; a field added since keeps its starting value)."""
        for name, value in state.items():
            if name in ("start", "recent"):
                value = {**{key: [] for key in WATCHED}, **value}
            setattr(self, name, value)
