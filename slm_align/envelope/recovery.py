"""The collapse watchdog (envelope/watchdog.py) wired to a live run: the probe, the best iteration's
weights kept and put back, the learning rate, KL coefficient and call-format shaping lowered or
raised, and each event said, logged and recorded.

The probe samples one completion per held-out prompt with the recipe's seed inside a forked RNG, so
a run with the watchdog trains on exactly the draws of a run without it until the first event. It
scores with the reward's base weights: the call-format shaping changes what training is paid, not
the yardstick of the best adapter. A reward drop is confirmed by probing the current adapter on
fresh seeds (offsets 1, 2, ... of :func:`fresh_seed`).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Optional

import torch

from slm_align.atomic import write_text_atomic
from slm_align.envelope.watchdog import SHAPING_TERM, Watchdog
from slm_align.envelope.watchdog_text import event_line
from slm_align.envelope.world import World
from slm_align.tracking import Tracker

EVENTS = "events.jsonl"
FRESH_STRIDE = 104_729
"""The distance between the seeds of the probe's fresh draws (a prime, so that they fall on no
seed the run derives by small steps)."""


def fresh_seed(seed: int, offset: int) -> int:
    """The probe's seed for draw ``offset``: 0 is the probe every iteration shares, 1, 2, ... the
    fresh ones of a reward-drop confirmation."""
    return seed + FRESH_STRIDE * offset


def probe_rewards(loop, prompts: list[str], seed: int) -> list[float]:
    """The rewards of the current adapter on ``prompts`` (:meth:`Learner.sample_rewards`: one
    completion or agent episode each), with ``seed`` so that every probe of a run draws with the
    same random numbers; the global RNG is left as it was (training draws do not depend on the
    probes)."""
    with torch.random.fork_rng():
        return loop.sample_rewards(prompts, seed)


def capture(loop) -> dict:
    """A copy of the learner's trainable parameters (value head included) and optimizer state."""
    return {"params": {name: p.detach().clone() for name, p in loop.named_params},
            "optimizer": copy.deepcopy(loop.optimizer.state_dict())}


def restore(loop, state: dict) -> None:
    """Put a :func:`capture` back bit for bit (copied again, so that later steps never
    write into the kept one)."""
    with torch.no_grad():
        for name, param in loop.named_params:
            param.copy_(state["params"][name])
            param.grad = None
    loop.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))


def scale_shaping(loop, factor: float) -> None:
    """Weigh the reward's call-format term (:data:`SHAPING_TERM`) at ``factor`` times its base
    weight, when the learner's reward can: duck-typed, ``reward_fn.scale_term(name, factor)``
    (:class:`~slm_align.ondevice.rewards.protocol.CombinedReward` has it, a column wrapper passes it on)."""
    scale_term = getattr(loop.reward_fn, "scale_term", None)
    if callable(scale_term):
        scale_term(SHAPING_TERM, factor)


def apply_scales(loop, watchdog: Watchdog, base_beta: float) -> None:
    """The learning rate (base times ``lr_scale``, under the warmup's share), GRPO's beta (base times
    ``kl_scale``) and the call-format shaping (base weight times ``shaping_scale``) the watchdog asks for.

    PPO's kl_coef lives in the learner's own state (and checkpoint); the event
    multiplies it directly."""
    loop.lr_scale = watchdog.lr_scale
    loop.set_learning_rate()
    loop.rescale_kl(base_beta, watchdog.kl_scale)
    scale_shaping(loop, watchdog.shaping_scale)


def keep_events_until(path: Path, step: int) -> None:
    """Drop the events a killed run logged after its checkpoint (they happen again on resume)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.endswith("\n") and json.loads(line)["step"] <= step]
    write_text_atomic(path, "".join(kept))


class WatchedRun:
    """One run's watchdog at work: probes, triggers and their actions on the learner,
    events written by rank 0. ``probe(offset)`` gives the probe's per-prompt rewards of the current
    adapter with seed offset ``offset`` (:func:`fresh_seed`; 0: the probe every iteration shares)."""

    def __init__(self, watchdog: Watchdog, probe, partial: Path, world: World, say, base_beta: float):
        self.watchdog = watchdog
        self.probe = probe
        self.events_path = partial / EVENTS
        self.world = world
        self.say = say
        self.base_beta = base_beta
        self.seconds = 0.0  # the watchdog's own work in this process (probes, weights kept and put back)
        self.tracker = Tracker()

    def begin(self, loop, tracker: Optional[Tracker] = None) -> None:
        """Before the first iteration: the probe of the starting adapter (a fresh run), the scales
        (a resumed run); events go to ``tracker`` too."""
        if tracker is not None:
            self.tracker = tracker
        loop.kl_watched = bool(self.watchdog.settings.max_kl)  # the KL-runaway detector reads the "kl" metric
        if self.world.main:
            keep_events_until(self.events_path, loop.step)
        apply_scales(loop, self.watchdog, self.base_beta)
        if self.watchdog.best_step is None:
            started = time.perf_counter()
            self.watchdog.record_probe(loop.step, self._probe(loop), lambda: capture(loop), self._reprobe(loop))
            self.seconds += time.perf_counter() - started

    def _probe(self, loop, offset: int = 0) -> list[float]:
        """The probe's per-prompt rewards with seed ``offset`` (:func:`fresh_seed`), scored with the
        reward's base weights."""
        scale_shaping(loop, 1.0)
        try:
            return self.probe(offset)
        finally:
            scale_shaping(loop, self.watchdog.shaping_scale)

    def _reprobe(self, loop):
        """``reprobe(offset)`` for :meth:`Watchdog.record_probe`: the current adapter's probe with
        the fresh seed ``offset``."""

        def reprobe(offset: int) -> list[float]:
            return self._probe(loop, offset)

        return reprobe

    def after_step(self, loop, metrics: dict) -> None:
        """After an iteration: observe, probe when due (its mean joins ``metrics``),
        check and act on a trigger."""
        started = time.perf_counter()
        self._watch(loop, metrics)
        self.seconds += time.perf_counter() - started

    def _watch(self, loop, metrics: dict) -> None:
        watchdog = self.watchdog
        watchdog.observe(metrics)
        flagged = self.world.share(watchdog.windowed())  # rank 0's windows decide for every replica
        if watchdog.probe_due(loop.step, loop.settings.steps):
            rewards = self._probe(loop)
            if flagged is None:  # an iteration a window flags is never the one published or returned to
                watchdog.record_probe(loop.step, rewards, lambda: capture(loop), self._reprobe(loop))
            metrics["watchdog/probe_reward"] = sum(rewards) / len(rewards)
        trigger = self.world.share(watchdog.check())
        if trigger is None:
            return
        event = self._act(loop, trigger)
        metrics["watchdog/event"] = event["detector"]
        self.say(event_line(event))
        if self.world.main:
            with open(self.events_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(event) + "\n")
            self.tracker.event(loop.step, event)

    def _act(self, loop, trigger) -> dict:
        """Roll back to the best (lower learning rate, higher KL coefficient on KL runaway,
        heavier call-format shaping on tool-use collapse) or stop; the event."""
        event = self.watchdog.respond(loop.step, trigger)
        if event["action"] == "rollback":
            restore(loop, self.watchdog.best_state)
            if trigger.detector == "kl_runaway":
                loop.raise_kl(self.watchdog.settings.kl_factor, self.base_beta, self.watchdog.kl_scale)
            apply_scales(loop, self.watchdog, self.base_beta)
        event["learning_rate"] = loop.optimizer.param_groups[0]["lr"]
        event["kl_coef"] = loop.kl_weight()
        return event

    @property
    def stopped(self) -> Optional[str]:
        """Why the run stopped early, or None."""
        return self.watchdog.stopped


def read_events(path: Path) -> list[dict]:
    """The events of a run's ``rl/events.jsonl`` (none when the file is missing)."""
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]
