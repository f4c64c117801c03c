"""The step loop both envelope runs share (PPO/GRPO and DPO/KTO): each step's metrics
appended to ``metrics.jsonl`` and reported to the tracker, a progress bar, and checkpoints
for a bit-identical resume.

A run resumed from its checkpoint first cuts ``metrics.jsonl`` back to the checkpoint's step (a
killed run may have logged past it), so every step is logged exactly once.
"""

from __future__ import annotations

import json
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


def train_steps(run: Stepped, next_step: Callable[[], dict], total: int, partial: Path, *, title: str,
                status: Callable[[dict], str], save_every: int, state: Callable[[], dict], world: World,
                tracker: Tracker, stopped: Callable[[], bool] = never) -> None:
    """Take the remaining steps of ``run`` up to ``total`` (``next_step()`` takes one and
    returns its metrics), until ``stopped()``. Rank 0 appends each step's metrics and reports
    them to ``tracker``, and saves ``state()`` every ``save_every`` steps, at the last step and
    when the run stops early."""
    metrics_path = Path(partial) / METRICS
    if world.main:
        keep_first_lines(metrics_path, run.step)  # steps after the checkpoint are taken again
    with new_progress() as progress:
        task = progress.add_task(title, total=total, completed=run.step, status="")
        while run.step < total and not stopped():
            with within_step(progress, f"{title} step {run.step + 1}/{total}"):
                metrics = next_step()
            progress.update(task, completed=run.step, status=status(metrics))
            if not world.main:
                continue
            append_metrics(metrics_path, metrics)
            tracker.log(run.step, metrics)
            if run.step % save_every == 0 or run.step == total or stopped():
                save_checkpoint(partial, state())
