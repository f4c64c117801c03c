"""Experiment tracking (``--report-to``): one run per stage in TensorBoard, Weights & Biases, MLflow
or Trackio, with the recipe as its config, beside the JSONL files the stages write anyway.

The Trainer stages (SFT, reward model) report through transformers' own integrations:
:meth:`Tracker.trainer_arguments` gives ``report_to`` and ``logging_dir``, and the run the tracker
opened first is the one they log into. RL, DPO/KTO and the watchdog's events call
:meth:`Tracker.log` and :meth:`Tracker.event` where they append to ``metrics.jsonl`` and
``events.jsonl``, with the iteration (step) as the library's step.

Where runs go: TensorBoard event files in ``OUT/tracking/<stage>/``; wandb offline in
``OUT/tracking/<stage>/wandb/`` unless ``WANDB_MODE`` is set; MLflow in a local file store
``OUT/tracking/<stage>/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set; Trackio in its own local
store (``TRACKIO_DIR``), project ``slm-align``, on no Space unless ``TRACKIO_SPACE_ID`` is set.

Resuming: a stage resumed from its checkpoint at step C trains steps C+1... again. TensorBoard gets
a purge marker at C+1 (``SummaryWriter(purge_step=C+1)``): its reader drops the killed attempt's
values from C+1 on and shows the new ones. wandb, MLflow and Trackio continue the stage's run (its
id and last logged step are in ``OUT/tracking/<stage>/run.json``) and skip the steps it already
holds, so no step is logged twice.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import secrets
from pathlib import Path
from typing import Optional

from slm_align.atomic import write_json_atomic
from slm_align.errors import UserError

PROJECT = "slm-align"
RUN_RECORD = "run.json"


def tracking_dir(out: Path, stage: str) -> Path:
    """Where a stage's tracker writes: ``OUT/tracking/<stage>/``."""
    return Path(out) / "tracking" / stage


def require_library(report_to: str) -> None:
    """Refuse in one line (exit 2) when the tracker's library is not
    installed; nothing is written."""
    if report_to == "none":
        return
    try:
        importlib.import_module(report_to)
    except ImportError:
        raise UserError(f"--report-to {report_to} needs the {report_to} package: "
                        f"pip install {report_to}") from None


def scalars(metrics: dict) -> dict[str, float]:
    """The numbers of a metrics line (its step, the x-axis, and booleans, strings,
    lists and None left out)."""
    numbers = {}
    for key, value in metrics.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = float(value)
    return numbers


class Tracker:
    """The null tracker (``--report-to none``): reports nothing and writes nothing."""

    def trainer_arguments(self) -> dict:
        """TrainingArguments for transformers' integrations."""
        return {"report_to": []}

    def log(self, step: int, metrics: dict) -> None:
        """One step's metrics (the numbers among them)."""

    def event(self, step: int, record: dict) -> None:
        """A watchdog event at ``step``."""

    def close(self) -> None:
        """End the run (files flushed)."""


def open_tracker(recipe, out: Path, stage: str, resume_step: Optional[int] = None) -> Tracker:
    """The stage's tracker: a new run, or (``resume_step`` = the checkpoint's step) the run
    of the interrupted one."""
    report_to = recipe.tracking.report_to
    if report_to == "none":
        return Tracker()
    require_library(report_to)
    directory = tracking_dir(out, stage)
    directory.mkdir(parents=True, exist_ok=True)
    return TRACKERS[report_to](directory, stage, recipe.model_dump(mode="json"), resume_step)


class TensorBoardTracker(Tracker):
    """Event files in the stage's directory; the recipe as a text summary, watchdog events
    as text at their step."""

    def __init__(self, directory: Path, stage: str, config: dict, resume_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        purge_step = 1  # a fresh run hides whatever an earlier run left in the directory
        if resume_step is not None:
            purge_step = resume_step + 1
        self.writer = SummaryWriter(str(directory), purge_step=purge_step)
        self.writer.add_text("recipe", f"```json\n{json.dumps(config, indent=2)}\n```")

    def trainer_arguments(self) -> dict:
        return {"report_to": ["tensorboard"], "logging_dir": str(self.directory)}

    def log(self, step: int, metrics: dict) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)

    def event(self, step: int, record: dict) -> None:
        self.writer.add_text("watchdog/events", json.dumps(record), step)

    def close(self) -> None:
        self.writer.close()


class StoredRun(Tracker):
    """A run kept in a library's store. Its id and last logged step live in ``run.json``: a
    resumed stage continues the run and skips the steps it already holds (they were trained
    again from the checkpoint)."""

    name = ""

    def __init__(self, directory: Path, stage: str, config: dict, resume_step: Optional[int]):
        self.directory = directory
        self.stage = stage
        self.config = config
        record = {}
        if resume_step is not None and (directory / RUN_RECORD).is_file():
            record = json.loads((directory / RUN_RECORD).read_text(encoding="utf-8"))
        self.last_step = record.get("last_step", -math.inf)
        self.run_id = self.open(record.get("run_id"))
        self._record()

    def open(self, run_id: Optional[str]) -> str:
        """Start the run, or continue ``run_id``; returns its id."""
        raise NotImplementedError

    def send(self, step: int, values: dict) -> None:
        """Log ``values`` at ``step`` in the library."""
        raise NotImplementedError

    def trainer_arguments(self) -> dict:
        return {"report_to": [self.name], "logging_dir": str(self.directory),
                "run_name": self.stage}

    def log(self, step: int, metrics: dict) -> None:
        if step <= self.last_step:
            return
        self.send(step, scalars(metrics))
        self.last_step = step
        self._record()

    def event(self, step: int, record: dict) -> None:
        if step > self.last_step:
            self.send(step, {"watchdog/events": json.dumps(record)})

    def _record(self) -> None:
        last_step = None
        if self.last_step != -math.inf:
            last_step = self.last_step
        write_json_atomic(self.directory / RUN_RECORD, {"library": self.name, "run_id": self.run_id,
                                                        "last_step": last_step})


class WandbTracker(StoredRun):
    """Weights & Biases, offline unless ``WANDB_MODE`` says otherwise, in
    ``OUT/tracking/<stage>/wandb/``."""

    name = "wandb"

    def open(self, run_id: Optional[str]) -> str:
        import wandb

        resume = None
        if run_id is not None:
            resume = "allow"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=self.stage,
                              dir=str(self.directory), config=self.config, id=run_id, resume=resume,
                              mode=os.environ.get("WANDB_MODE", "offline"))
        return self.run.id

    def send(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(StoredRun):
    """MLflow, in a local file store under the stage's directory unless
    ``MLFLOW_TRACKING_URI`` is set; the recipe as the artifact ``recipe.json``, watchdog
    events as artifacts under ``watchdog/``."""

    name = "mlflow"

    def open(self, run_id: Optional[str]) -> str:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless this is set
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((self.directory / "mlruns").resolve().as_uri())
        if run_id is None:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
            run = mlflow.start_run(run_name=self.stage)
            mlflow.log_dict(self.config, "recipe.json")
            return run.info.run_id
        return mlflow.start_run(run_id=run_id).info.run_id

    def send(self, step: int, values: dict) -> None:
        import mlflow

        mlflow.log_metrics(values, step=step)

    def event(self, step: int, record: dict) -> None:
        import mlflow

        if step > self.last_step:
            mlflow.log_dict(record,
                            f"watchdog/step-{step:06d}-{record.get('detector', 'event')}.json")

    def close(self) -> None:
        import mlflow

        mlflow.end_run()


class TrackioTracker(StoredRun):
    """Trackio, in its local store (``TRACKIO_DIR``), project ``slm-align``, one run
    per stage named after it."""

    name = "trackio"

    def open(self, run_id: Optional[str]) -> str:
        import trackio

        name = run_id
        if name is None:
            name = f"{self.stage}-{secrets.token_hex(3)}"
        self.run = trackio.init(project=PROJECT, name=name, config=self.config, resume="allow")
        return name

    def trainer_arguments(self) -> dict:
        # transformers' callback would deploy to the Space "trackio" by default: local, as the
        # stages' own runs
        return dict(super().trainer_arguments(), project=PROJECT, run_name=self.run_id,
                    trackio_space_id=None)

    def send(self, step: int, values: dict) -> None:
        import trackio

        trackio.log(values, step=step)

    def close(self) -> None:
        # this tracker's own run, flushed (in a Trainer stage transformers' callback re-opens the
        # run by name and finishes what it opened itself)
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
            "trackio": TrackioTracker}


def close_trainer_writers(trainer) -> None:
    """Close the event writers transformers' TensorBoard callback (re)opened, e.g. for an evaluation
    after training, so that every value is on disk when the stage ends."""
    for callback in trainer.callback_handler.callbacks:
        writer = getattr(callback, "tb_writer", None)
        if writer is not None:
            writer.close()


def trainer_tracker(recipe, out: Path, stage: str, checkpoint: Optional[str]) -> Tracker:
    """The tracker of a Trainer stage, continuing from the step of the Trainer
    checkpoint it resumes (if any)."""
    resume_step = None
    if checkpoint is not None:
        resume_step = int(Path(checkpoint).name.split("-")[-1])
    return open_tracker(recipe, out, stage, resume_step)


def finish_trainer_tracking(trainer, tracker: Tracker) -> None:
    """End a Trainer stage's run: transformers' TensorBoard writers closed, then the tracker."""
    close_trainer_writers(trainer)
    tracker.close()
