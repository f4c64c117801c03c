"""Plumbing shared by the stages that train on transformers' Trainer (SFT, reward model): the world,
the work dir, the arguments, the trainer, and the callback behind their progress and JSONL logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from transformers import TrainerCallback

from slm_align.config import TrainSettings
from slm_align.envelope.world import World, rank_device, replica_digest, world_from_env
from slm_align.modeling.accelerator import Compute
from slm_align.progress import new_progress
from slm_align.tracking import Tracker, trainer_tracker


def trainer_world(compute: Compute) -> World:
    """The world of a Trainer stage: under ``accelerate launch``/``torchrun`` (WORLD_SIZE > 1) the
    process group set up here, before the Trainer, which takes it over for DDP or DeepSpeed, so that
    rank 0 alone can prepare and publish the stage's folder; one process otherwise."""
    return world_from_env(rank_device(compute.device))


def replica_record(world: World, model) -> dict:
    """What the manifest records of the ranks (called on every rank, before rank 0
    publishes): their number and each one's digest of the trained weights, equal when
    gradients were averaged across them."""
    digests = world.gather(replica_digest(p for p in model.parameters() if p.requires_grad))
    return {"world_size": world.size, "replica_digests": digests, "replicas_identical": len(set(digests)) == 1}


def trainer_logging(recipe, out: Path, stage: str, partial: Path, checkpoint: Optional[str], world: World,
                    name: str) -> tuple["TrainerProgress", Tracker]:
    """The progress callback and tracker of a Trainer stage's rank: rank 0 writes
    ``partial/log.jsonl`` and reports (continuing the run of the checkpoint it resumes); the
    other ranks train only."""
    if not world.main:
        return TrainerProgress(name, None), Tracker()
    return TrainerProgress(name, partial / "log.jsonl"), trainer_tracker(recipe, out, stage, checkpoint)


def training_arguments(settings: TrainSettings, seed: int, partial: Path, compute: Compute,
                       tracker: Optional[Tracker] = None, **extra):
    """TrainingArguments with a cosine schedule, checkpoints and our own progress bar, on the
    stage's device (the CPU only when it resolved to the CPU), in its precision, with gradient
    checkpointing when asked; reporting to the stage's tracker (none by default)."""
    from transformers import TrainingArguments

    if tracker is None:
        tracker = Tracker()
    return TrainingArguments(
        output_dir=str(partial / "checkpoints"), num_train_epochs=settings.epochs, max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size, per_device_eval_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.grad_accum, learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine", warmup_ratio=settings.warmup_ratio, weight_decay=settings.weight_decay,
        save_strategy="steps", save_steps=settings.save_steps, save_total_limit=2, logging_steps=10,
        seed=seed, data_seed=seed, disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, save_safetensors=True, **tracker.trainer_arguments(), **compute.trainer_arguments(),
        **extra,
    )


def trainable_base(model, compute: Compute):
    """The base model LoRA attaches to: with 4-bit weights, prepared for k-bit training (QLoRA:
    norms in fp32, input gradients on); otherwise as it is."""
    if not compute.load_in_4bit:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=compute.gradient_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def make_trainer(trainer_class, model, args, train_rows, collate, progress, **kwargs):
    """A Trainer with our progress callback in place of its stdout printer."""
    from transformers import PrinterCallback

    trainer = trainer_class(model=model, args=args, train_dataset=train_rows, data_collator=collate,
                            callbacks=[progress], **kwargs)
    trainer.remove_callback(PrinterCallback)  # our progress bar and log.jsonl replace its stdout dicts
    return trainer


class TrainerProgress(TrainerCallback):
    """A Trainer callback that drives the stage's progress (bar or lines) and appends each log
    to a JSONL file (none when ``log_path`` is None: the other ranks of a data-parallel run,
    whose rank 0 writes it)."""

    def __init__(self, name: str, log_path: Optional[Path]):
        self.name = name
        self.log_path = log_path
        self.eval_losses: list[float] = []
        self.last_eval: Optional[tuple[int, dict]] = None
        """The step of the latest evaluation and its metrics (None before one)."""
        self._progress = new_progress()
        self._task = None
        self._eval_task = None
        self._eval_done = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._progress.start()
        self._task = self._progress.add_task(self.name, total=state.max_steps, completed=state.global_step,
                                             status="", ends_at_total=False)

    def on_step_end(self, args, state, control, **kwargs):
        self._progress.update(self._task, completed=state.global_step)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        """One batch of an evaluation: its progress in batches, as a task of its own."""
        if self._eval_task is None:
            batches = len(eval_dataloader) if eval_dataloader is not None else None
            self._eval_task = self._progress.add_task(f"{self.name}: evaluation", total=batches, completed=0,
                                                      status="", unit="batches")
        self._eval_done += 1
        self._progress.update(self._eval_task, completed=self._eval_done)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self._eval_task is not None:
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
            self._eval_done = 0
        self.last_eval = (state.global_step, dict(metrics or {}))

    def final_evaluation(self, trainer, steps: int) -> dict:
        """The metrics of the weights after ``steps``: the evaluation the epoch's end already ran at
        that step (no second pass over the same documents), else a new one."""
        if self.last_eval is not None and self.last_eval[0] == steps:
            return self.last_eval[1]
        return trainer.evaluate()

    def finish(self) -> None:
        """The stage's training and evaluation are over: its end line."""
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._progress.stop()

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

