"""The Trainer callback behind the SFT and reward stages' progress (bars or lines, see :mod:`slm_align.progress`)
and their JSONL logs; apart from :mod:`slm_align.progress` so that torch-free commands (``bench``) can show
progress without importing transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from transformers import TrainerCallback

from slm_align.progress import new_progress


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
