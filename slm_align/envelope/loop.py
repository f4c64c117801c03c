"""The step loop both envelope runs share (PPO/GRPO and DPO/KTO): each step's metrics
appended to ``metrics.jsonl`` and reported to the tracker, a progress bar, and checkpoints
for a bit-identical resume.

A run resumed from its checkpoint first cuts ``metrics.jsonl`` back to the checkpoint's step (a
killed run may have logged past it), so every step is logged exactly once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from slm_align.atomic import atomic_path
from slm_align.envelope.world import World
from slm_align.progress import new_progress, within_step
from slm_align.runs import keep_first_lines
from slm_align.tracking import Tracker

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


class Stepped(Protocol):
    """A run that counts the steps it has taken."""

    step: int


def never() -> bool:
    """A run that does not stop early."""
    return False


def load_checkpoint(partial: Path) -> Optional[dict]:
    """The state saved in the work dir by :func:`save_checkpoint`, or None when there is none."""
    path = Path(partial) / CHECKPOINT
    if not path.is_file():
        return None
    return torch.load(path, weights_only=True)


def save_checkpoint(partial: Path, state: dict) -> None:
    """Write a run's state into its work dir atomically (a kill mid-write leaves
    the previous checkpoint)."""
    with atomic_path(Path(partial) / CHECKPOINT) as tmp:
        torch.save(state, tmp)


def append_metrics(path: Path, metrics: dict) -> None:
    """One step's metrics as a line of ``metrics.jsonl``."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(metrics) + "\n")


@dataclass(frozen=True)
class StepPlan:
    """What the step loop runs: one step at a time up to ``total``, until ``stopped()``."""

    next_step: Callable[[], dict]
    """Takes one step of the run and returns its metrics."""
    total: int
    """The step count the run ends at."""
    title: str
    """The progress bar's title ("RL (grpo)", "DPO")."""
    status: Callable[[dict], str]
    """A step's metrics as the bar's short status."""
    stopped: Callable[[], bool] = never
    """True once the run stops early (the watchdog)."""


@dataclass(frozen=True)
class StepRecord:
    """Where the step loop keeps what the run did; rank 0 alone writes."""

    partial: Path
    """The stage's work dir: ``metrics.jsonl`` and the checkpoint."""
    state: Callable[[], dict]
    """The run's state, as a checkpoint holds it."""
    save_every: int
    """Checkpoint every this many steps (and at the last step, and on an early stop)."""
    world: World
    """The ranks (rank 0 writes the metrics and checkpoints)."""
    tracker: Tracker
    """Where each step's metrics are reported besides ``metrics.jsonl``."""


def train_steps(run: Stepped, plan: StepPlan, record: StepRecord) -> None:
    """Take the remaining steps of ``run`` up to ``plan.total`` (``plan.next_step()`` takes one
    and returns its metrics), until ``plan.stopped()``. Rank 0 appends each step's metrics and
    reports them to the tracker, and saves ``record.state()`` every ``save_every`` steps, at the
    last step and when the run stops early."""
    metrics_path = Path(record.partial) / METRICS
    main = record.world.main
    total = plan.total
    if main:
        keep_first_lines(metrics_path, run.step)  # steps after the checkpoint are taken again
    with new_progress() as progress:
        task = progress.add_task(plan.title, total=total, completed=run.step, status="")
        while run.step < total and not plan.stopped():
            with within_step(progress, f"{plan.title} step {run.step + 1}/{total}"):
                metrics = plan.next_step()
            progress.update(task, completed=run.step, status=plan.status(metrics))
            if not main:
                continue
            append_metrics(metrics_path, metrics)
            record.tracker.log(run.step, metrics)
            due = run.step % record.save_every == 0 or run.step == total
            if due or plan.stopped():
                save_checkpoint(record.partial, record.state())
