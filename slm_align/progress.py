"""Progress for long stages, on stderr: rich bars on a terminal, plain lines in a log; JSONL metric logs.

When stderr is not a terminal (``nohup``, CI, a job scheduler, ``2> run.log``) every long stage writes plain lines
instead of bars: its start (what it will do and how much), its progress every ``SLM_ALIGN_PROGRESS_SECONDS``
seconds (30 by default; the last step always), and its end. ``--quiet`` silences both.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import TrainerCallback

stderr = Console(stderr=True)

CADENCE_ENV = "SLM_ALIGN_PROGRESS_SECONDS"
"""Seconds between two progress lines in a log (default 30)."""


def set_quiet(quiet: bool) -> None:
    """Silence (or restore) every progress bar and line of this process (the CLI's ``--quiet``)."""
    stderr.quiet = quiet


def cadence() -> float:
    """Seconds between two progress lines, from :data:`CADENCE_ENV`."""
    return float(os.environ.get(CADENCE_ENV, "30"))


def duration(seconds: float) -> str:
    """``75.2`` -> ``"1m15s"``; under a minute ``"42s"``; from an hour ``"1h05m"``."""
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{(whole % 3600) // 60:02d}m"


def say_line(text: str) -> None:
    """One plain progress line on stderr (nothing under ``--quiet``)."""
    stderr.print(f"[slm-align {time.strftime('%H:%M:%S')}] {text}", markup=False, highlight=False, soft_wrap=True)


@dataclass
class _Task:
    """One task of a :class:`LineProgress`: what it counts and when it last said so."""

    description: str
    total: Optional[float]
    completed: float
    status: str
    started: float
    said: float
    done: bool = False


class LineProgress:
    """The part of rich's Progress the stages use (``add_task``, ``update``, a context manager), as plain lines."""

    def __init__(self):
        self.tasks: list[_Task] = []

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Nothing to start: lines are written as they come."""

    def stop(self) -> None:
        """The end line of every task not yet finished."""
        for task in self.tasks:
            self._finish(task)

    def add_task(self, description: str, total: Optional[float] = None, completed: float = 0, status: str = "",
                 **_) -> int:
        """Start a task: its start line (how much it will do); its id."""
        now = time.monotonic()
        self.tasks.append(_Task(description, total, completed, status, now, now))
        resumed = f", resuming at {completed:g}" if completed else ""
        say_line(f"{description}: start, {total:g} steps{resumed}" if total else f"{description}: start")
        return len(self.tasks) - 1

    def update(self, task_id: int, completed: Optional[float] = None, status: Optional[str] = None, **_) -> None:
        """Record progress; a line when the cadence has passed or the last step is reached."""
        task = self.tasks[task_id]
        if task.done:
            return
        if completed is not None:
            task.completed = completed
        if status is not None:
            task.status = status
        now = time.monotonic()
        last = task.total is not None and task.completed >= task.total
        if last or now - task.said >= cadence():
            task.said = now
            say_line(self._progress_text(task, now))
        if last:
            self._finish(task)

    def _progress_text(self, task: _Task, now: float) -> str:
        elapsed = now - task.started
        text = f"{task.description}: step {task.completed:g}/{task.total:g}" if task.total else task.description
        if task.status:
            text += f" ({task.status})"
        text += f", {duration(elapsed)} elapsed"
        if task.total and 0 < task.completed < task.total:
            text += f", about {duration(elapsed / task.completed * (task.total - task.completed))} left"
        return text

    def _finish(self, task: _Task) -> None:
        if task.done:
            return
        task.done = True
        say_line(f"{task.description}: done, {task.completed:g} steps in {duration(time.monotonic() - task.started)}")


def new_progress() -> Union[Progress, LineProgress]:
    """Bars on a terminal, lines in a log (see the module's doc); both silent under ``--quiet``."""
    if not stderr.is_terminal:
        return LineProgress()
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=stderr, transient=True)


class _DeferredLine:
    """A stage's start line, said once: at once when the cadence is 0, else when the stage is still running after
    one cadence (a timer thread). A stage refused within that time (bad input) thus leaves only its error line."""

    def __init__(self, text: str):
        self.text = text
        self.said = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(cadence(), self.say)
        self._timer.daemon = True

    def arm(self) -> None:
        """Say the line now (cadence 0) or start the timer."""
        if cadence() <= 0:
            self.say()
            return
        self._timer.start()

    def say(self) -> None:
        """Say the line unless it was said or cancelled."""
        with self._lock:
            if self.said:
                return
            self.said = True
        say_line(self.text)

    def cancel(self) -> bool:
        """Stop the timer; whether the line had been said."""
        self._timer.cancel()
        with self._lock:
            said = self.said
            self.said = True
        return said


@contextmanager
def stage_lines(name: str, start: str) -> Iterator[None]:
    """Start and end lines around a stage without steps (the gate, an evaluation, an export) when stderr is a log;
    on a terminal the stage's own output says enough. The start line waits one cadence (see
    :class:`_DeferredLine`); a stage shorter than that says one line at its end, with what it did."""
    if stderr.is_terminal:
        yield
        return
    started = time.monotonic()
    line = _DeferredLine(f"{name}: start, {start}")
    line.arm()
    try:
        yield
    finally:
        said = line.cancel()
    took = duration(time.monotonic() - started)
    if said:
        say_line(f"{name}: done in {took}")
        return
    say_line(f"{name}: done in {took} ({start})")


class TrainerProgress(TrainerCallback):
    """A Trainer callback that drives the stage's progress (bar or lines) and appends each log to a JSONL file (none
    when ``log_path`` is None: the other ranks of a data-parallel run, whose rank 0 writes it)."""

    def __init__(self, name: str, log_path: Optional[Path]):
        self.name = name
        self.log_path = log_path
        self.eval_losses: list[float] = []
        self._progress = new_progress()
        self._task = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._progress.start()
        self._task = self._progress.add_task(self.name, total=state.max_steps, completed=state.global_step,
                                             status="")

    def on_step_end(self, args, state, control, **kwargs):
        self._progress.update(self._task, completed=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {}, step=state.global_step)
        if "eval_loss" in logs:
            self.eval_losses.append(logs["eval_loss"])
        if "loss" in logs:
            self._progress.update(self._task, status=f"loss {logs['loss']:.3f}")
        if self.log_path is None:
            return
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(logs) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self._progress.stop()
