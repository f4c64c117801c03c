"""Progress for long stages, on stderr: rich bars on a terminal, plain lines in a log (the Trainer
callback that drives them for SFT and the reward model, and writes their JSONL logs, is
:mod:`slm_align.envelope.trainer`).

When stderr is not a terminal (``nohup``, CI, a job scheduler, ``2> run.log``) every long stage
writes plain lines instead of bars: its start (what it will do and how much), its progress every
``SLM_ALIGN_PROGRESS_SECONDS`` seconds (30 by default; the last step always), and its end.
``--quiet`` silences both.

A stage without optimizer steps (the gate, an evaluation, an export's verification) runs inside
:func:`stage_lines`; the loops it runs count their items with :func:`counted` (documents scored,
tokens sampled, prompts decoded), which shows as a bar on a terminal and as a line every cadence in
a log. A step of a training loop (an RL iteration, minutes long on a real model) runs inside
:func:`within_step`: the loops it counts (its rollouts) speak through the loop's own bar or lines,
so that a log hears from a long step at least once a cadence while its work advances.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

stderr = Console(stderr=True)

CADENCE_ENV = "SLM_ALIGN_PROGRESS_SECONDS"
"""Seconds between two progress lines in a log (default 30)."""


def quiet(_: str) -> None:
    """A ``say`` that says nothing (library callers that want no stage lines)."""


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
    stderr.print(f"[slm-align {time.strftime('%H:%M:%S')}] {text}",
                 markup=False, highlight=False, soft_wrap=True)


@dataclass
class _Task:
    """One task of a :class:`LineProgress`: what it counts and how far it is."""

    description: str  # what the lines call it: "sft", "headroom gate: perplexity"
    total: Optional[float]  # how many units it will do (None: unknown)
    completed: float  # how many are done
    status: str  # its key figure now ("loss 0.703"), said in brackets
    started: float  # time.monotonic() at its start (elapsed and remaining time)
    unit: str = "steps"  # what it counts: steps ("step k/N") or anything else ("k/N documents")
    ends_at_total: bool = True  # its end line comes with its last unit (else: when it is removed)
    ends: bool = True  # it says its start, its last unit and its end (else only its cadence lines)
    done: bool = False  # its end was reached: no more lines


class LineProgress:
    """The part of rich's Progress the stages use (``add_task``, ``update``, ``remove_task``, a
    context manager), as plain lines: at most one line per cadence, whichever task it is about.

    ``ends``: each task says its start, its last step and its end (a training stage); without, only
    its cadence lines (the counted loops of a stage whose start and end :func:`stage_lines` says).
    ``before_line`` is called before every line (the stage's start line, said first); ``since`` is
    when the cadence starts (default: now).
    """

    def __init__(self, ends: bool = True, before_line: Optional[Callable[[], None]] = None,
                 since: Optional[float] = None):
        self.tasks: list[_Task] = []
        self.ends = ends
        self.before_line = before_line
        self.said = time.monotonic() if since is None else since

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

    def add_task(self, description: str, total: Optional[float] = None, completed: float = 0,
                 status: str = "", unit: str = "steps", ends_at_total: bool = True,
                 ends: Optional[bool] = None, **_) -> int:
        """Start a task: its start line (how much it will do) when ``ends`` (default: the
        progress's); its id. A task that does more after its last unit (a training stage's final
        evaluation) passes ``ends_at_total=False`` and says its end when removed."""
        ends = self.ends if ends is None else ends
        self.tasks.append(_Task(description, total, completed, status, time.monotonic(), unit,
                                ends_at_total, ends))
        if ends:
            resumed = f", resuming at {completed:g}" if completed else ""
            self._say(f"{description}: start, "
                      f"{total:g} {unit}{resumed}" if total else f"{description}: start")
        return len(self.tasks) - 1

    def remove_task(self, task_id: int) -> None:
        """The task is over: its end line when ``ends``, then no more lines."""
        self._finish(self.tasks[task_id])

    def update(self, task_id: int, completed: Optional[float] = None, status: Optional[str] = None,
               **_) -> None:
        """Record progress; a line when the cadence has passed or the last step is reached."""
        task = self.tasks[task_id]
        if task.done:
            return
        if completed is not None:
            task.completed = completed
        if status is not None:
            task.status = status
        now = time.monotonic()
        last = task.ends and task.total is not None and task.completed >= task.total
        if last or now - self.said >= cadence():
            self._say(self._progress_text(task, now))
        if last and task.ends_at_total:
            self._finish(task)

    def _say(self, text: str) -> None:
        if self.before_line is not None:
            self.before_line()
        self.said = time.monotonic()
        say_line(text)

    def _progress_text(self, task: _Task, now: float) -> str:
        elapsed = now - task.started
        text = task.description
        if task.total and task.unit == "steps":
            text += f": step {task.completed:g}/{task.total:g}"
        elif task.total:
            text += f" {task.completed:g}/{task.total:g} {task.unit}"
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
        if task.ends:
            took = duration(time.monotonic() - task.started)
            self._say(f"{task.description}: done, {task.completed:g} {task.unit} in {took}")


def new_progress() -> Union[Progress, LineProgress]:
    """Bars on a terminal, lines in a log (see the module's doc); both silent under ``--quiet``."""
    if not stderr.is_terminal:
        return LineProgress()
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=stderr,
                    transient=True)


class _DeferredLine:
    """A stage's start line, said once: at once when the cadence is 0, else when the stage is still
    running after one cadence (a timer thread). A stage refused within that time (bad input) thus
    leaves only its error line."""

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


class Stage:
    """A stage without optimizer steps, as :func:`stage_lines` yields it. Set ``figures`` to what
    its end line says (its key results: a perplexity, a spread, an agreement); its counted loops
    (:func:`counted`) show in its bar on a terminal or its cadence lines in a log."""

    def __init__(self, name: str, start: Optional[_DeferredLine]):
        self.name = name
        self.figures = ""
        self._start = start
        self._started = time.monotonic()
        self._progress = None

    @property
    def progress(self) -> Union[Progress, LineProgress]:
        """The stage's bars (terminal) or lines (log), made at its first counted loop."""
        if self._progress is None:
            self._progress = self._open()
        return self._progress

    def _open(self) -> Union[Progress, LineProgress]:
        if self._start is None:
            bars = new_progress()
            bars.start()
            return bars
        return LineProgress(ends=False, before_line=self._start.say, since=self._started)

    def close(self) -> None:
        """Take the bars off the terminal (nothing to do for lines)."""
        if self._progress is not None:
            self._progress.stop()


_STAGE: ContextVar[Optional[Stage]] = ContextVar("slm_align_stage", default=None)
"""The stage without steps that is running (None outside one)."""


@contextmanager
def stage_lines(name: str, start: str) -> Iterator[Stage]:
    """Start and end lines around a stage without steps (the gate, an evaluation, an export) when
    stderr is a log, and the progress of the loops it counts (:func:`counted`) between them; on a
    terminal those loops' bars.

    The start line waits one cadence (see :class:`_DeferredLine`); a stage shorter than that says
    one line at its end, with what it did. The end line carries the :class:`Stage`'s ``figures``."""
    if stderr.is_terminal:
        stage = Stage(name, None)
        try:
            with _running(stage):
                yield stage
        finally:
            stage.close()
        return
    started = time.monotonic()
    line = _DeferredLine(f"{name}: start, {start}")
    stage = Stage(name, line)
    line.arm()
    try:
        with _running(stage):
            yield stage
    finally:
        said = line.cancel()
    text = f"{name}: done in {duration(time.monotonic() - started)}"
    if not said:
        text += f" ({start})"
    if stage.figures:
        text += f": {stage.figures}"
    say_line(text)


@contextmanager
def _running(stage: Stage) -> Iterator[None]:
    token = _STAGE.set(stage)
    try:
        yield
    finally:
        _STAGE.reset(token)


@contextmanager
def within_step(progress: Union[Progress, LineProgress], name: str) -> Iterator[None]:
    """Run one step of a training loop whose bar or lines are ``progress``: the loops the step
    counts (:func:`counted`: an RL iteration's rollouts) show as ``name: what`` in the same bar or
    lines, so that a log gets a line at least once a cadence while the step's work advances (RL on
    SmolLM2 took 2-3.5 minutes an iteration and said nothing between iterations: issue 44)."""
    stage = Stage(name, None)
    stage._progress = progress  # the loop's own: opened and closed by the loop, not by the step
    with _running(stage):
        yield


@dataclass
class Count:
    """One counted loop's progress (see :func:`counted`); inactive outside a stage."""

    progress: Optional[Union[Progress, LineProgress]]
    task: Optional[int]
    done: float = 0

    @property
    def active(self) -> bool:
        """Whether anything shows the count (the loop may then do a little
        extra work to report it)."""
        return self.progress is not None

    def advance(self, items: float = 1, status: Optional[str] = None) -> None:
        """``items`` more are done; ``status`` is the loop's key figure so far (said in
        brackets)."""
        if self.progress is None:
            return
        self.done += items
        self.progress.update(self.task, completed=self.done, status=status)


@contextmanager
def counted(what: str, total: float, unit: str) -> Iterator[Count]:
    """A loop of the running stage that does ``total`` ``unit`` (documents, tokens, prompts):
    ``what`` it does and ``k/total`` shown in the stage's bar, or in its line every cadence with
    elapsed and remaining time. Outside a stage or a step (:func:`within_step`: an RL iteration's
    rollouts; the reward stage's own accuracy) the count is inactive and shows nothing."""
    stage = _STAGE.get()
    if stage is None or total <= 0:
        yield Count(None, None)
        return
    progress = stage.progress
    task = progress.add_task(f"{stage.name}: {what}",
                             total=total, completed=0, status="", unit=unit, ends=False)
    try:
        yield Count(progress, task)
    finally:
        progress.remove_task(task)
