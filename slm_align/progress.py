"""Progress bars (rich, on stderr) and JSONL metric logs for long stages."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import TrainerCallback

stderr = Console(stderr=True)


def new_progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=stderr, transient=True)


class TrainerProgress(TrainerCallback):
    """A Trainer callback that drives a rich bar and appends each log line to a JSONL file."""

    def __init__(self, name: str, log_path: Path):
        self.name = name
        self.log_path = Path(log_path)
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
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(logs) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self._progress.stop()
