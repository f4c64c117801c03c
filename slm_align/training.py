"""Plumbing shared by the stages that train on transformers' Trainer (SFT, reward model)."""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slm_align.accelerator import Compute
from slm_align.atomic import publish_directory, write_json_atomic
from slm_align.config import LoraSettings, TrainSettings
from slm_align.errors import UserError
from slm_align.modeling import lora_targets
from slm_align.rl.distributed import World, rank_device, replica_digest, world_from_env
from slm_align.runs import digest, partial_dir
from slm_align.tracking import Tracker, trainer_tracker
from slm_align.trainer_progress import TrainerProgress


def trainer_world(compute: Compute) -> World:
    """The world of a Trainer stage: under ``accelerate launch``/``torchrun`` (WORLD_SIZE > 1) the process group set
    up here, before the Trainer, which takes it over for DDP or DeepSpeed, so that rank 0 alone can prepare and
    publish the stage's folder; one process otherwise."""
    return world_from_env(rank_device(compute.device))


@dataclass
class TrainerRun:
    """Where a Trainer stage's rank works: its world, the work dir, the checkpoint it resumes from, its progress
    callback and tracker (rank 0 writes the log and reports; the other ranks train only)."""

    world: World
    partial: Path
    checkpoint: Optional[str]
    progress: TrainerProgress
    tracker: Tracker

    def replicas(self, model) -> dict:
        """What the manifest records of the ranks (on every rank, before rank 0 publishes): their number and each
        one's digest of the trained weights, equal when gradients were averaged across them."""
        digests = self.world.gather(replica_digest(p for p in model.parameters() if p.requires_grad))
        return {"world_size": self.world.size, "replica_digests": digests, "replicas_identical": len(set(digests)) == 1}


def start_trainer_run(recipe, out: Path, stage: str, stage_dir: Path, inputs: dict, resume: bool, compute: Compute,
                      name: str) -> TrainerRun:
    """The work dir prepared on rank 0 (its checkpoint shared with every rank), rank 0's log and tracker."""
    world = trainer_world(compute)
    partial = partial_dir(stage_dir)
    checkpoint = world.on_main(functools.partial(prepare_partial, partial, inputs, resume))
    if not world.main:
        return TrainerRun(world, partial, checkpoint, TrainerProgress(name, None), Tracker())
    tracker = trainer_tracker(recipe, out, stage, checkpoint)
    return TrainerRun(world, partial, checkpoint, TrainerProgress(name, partial / "log.jsonl"), tracker)


def prepare_partial(partial: Path, inputs: dict, resume: bool) -> Optional[str]:
    """Create a stage's work dir, or check a leftover one; returns the Trainer checkpoint to resume from.

    The work dir appears with its inputs record already inside (built beside it and renamed), so a process
    killed at any moment leaves either no work dir or one that ``--resume`` can check.
    """
    marker = partial / "inputs.json"
    if partial.exists():
        if not resume:
            raise UserError(f"an interrupted run is in {partial}; pass --resume to continue it, "
                            "or remove that directory to start over")
        if not marker.is_file() or json.loads(marker.read_text())["inputs_hash"] != digest(inputs):
            raise UserError(f"{partial} was started with other inputs or settings; cannot resume it with these")
        return last_complete_checkpoint(partial / "checkpoints")
    staging = partial.with_name(partial.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_json_atomic(staging / "inputs.json", {"inputs_hash": digest(inputs), "inputs": inputs})
    publish_directory(staging, partial)
    return None


def last_complete_checkpoint(checkpoints: Path) -> Optional[str]:
    """The newest Trainer checkpoint that was written to the end; half-written ones (a kill mid-save) are removed.

    The Trainer writes ``trainer_state.json`` last, and not atomically, so a checkpoint is complete exactly when
    that file parses.
    """
    if not checkpoints.is_dir():
        return None
    found = sorted((d for d in checkpoints.iterdir() if d.is_dir() and d.name.startswith("checkpoint-")
                    and d.name.split("-")[-1].isdigit()), key=lambda d: int(d.name.split("-")[-1]))
    while found:
        newest = found.pop()
        try:
            json.loads((newest / "trainer_state.json").read_text(encoding="utf-8"))
            return str(newest)
        except (OSError, ValueError):
            shutil.rmtree(newest)
    return None


def training_arguments(settings: TrainSettings, seed: int, partial: Path, compute: Compute,
                       tracker: Optional[Tracker] = None, **extra):
    """TrainingArguments with a cosine schedule, checkpoints and our own progress bar, on the stage's device (the CPU
    only when it resolved to the CPU), in its precision, with gradient checkpointing when asked; reporting to the
    stage's tracker (none by default)."""
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
    """The base model LoRA attaches to: with 4-bit weights, prepared for k-bit training (QLoRA: norms in fp32,
    input gradients on); otherwise as it is."""
    if not compute.load_in_4bit:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=compute.gradient_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def attach_lora(model, lora: LoraSettings, seed: int, task_type: str = "CAUSAL_LM"):
    """Wrap ``model`` with a fresh LoRA adapter (for SEQ_CLS, peft also trains the score head)."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    set_seed(seed)
    targets = lora_targets(model.config.model_type, lora.target_modules)
    try:
        return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                target_modules=targets, task_type=task_type))
    except ValueError as exc:
        raise UserError(f"LoRA target modules {targets} do not match this model ({exc}); "
                        "name existing modules with --lora-targets") from None


def make_trainer(trainer_class, model, args, train_rows, collate, progress, **kwargs):
    """A Trainer with our progress callback in place of its stdout printer."""
    from transformers import PrinterCallback

    trainer = trainer_class(model=model, args=args, train_dataset=train_rows, data_collator=collate,
                            callbacks=[progress], **kwargs)
    trainer.remove_callback(PrinterCallback)  # our progress bar and log.jsonl replace its stdout dicts
    return trainer


def save_adapter(model, path: Path) -> None:
    with warnings.catch_warnings():  # peft warns when the base came from a .gguf or the bundled dir: harmless
        warnings.filterwarnings("ignore", message="Could not find a config file")
        model.save_pretrained(path, safe_serialization=True)
