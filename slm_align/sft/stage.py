"""Supervised fine-tuning: LoRA (peft) with NEFTune noise on transformers'
Trainer, in float32 on CPU.

Output, under ``OUT/sft/``: ``adapter/`` (peft), ``tokenizer/``, ``log.jsonl`` and
``manifest.json``. The stage works in ``OUT/sft.partial/`` (with Trainer checkpoints for
``--resume``) and is renamed into place only when complete, so a crash never leaves an
``sft/`` that looks whole.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

from slm_align.config import DataSettings, Recipe
from slm_align.config.from_sft import STAGE
from slm_align.data.corpus import Corpus, load_corpus
from slm_align.data.encoding import encode_all, pad_batch
from slm_align.envelope.trainer import (
    make_trainer,
    replica_record,
    trainable_base,
    trainer_logging,
    trainer_world,
    training_arguments,
)
from slm_align.errors import UserError
from slm_align.modeling.accelerator import check_trainer_device, resolve_compute, training_inputs
from slm_align.modeling.models import (
    ModelSource,
    attach_lora,
    load_model,
    load_tokenizer,
    model_record,
    resolve_source,
    save_adapter,
    save_tokenizer,
)
from slm_align.runs import WHERE, StageResult, run_stage
from slm_align.tracking import finish_trainer_tracking, require_library


def sft_inputs(recipe: Recipe, source: ModelSource, corpus: Corpus) -> dict:
    """Everything that decides the SFT result; equal inputs mean the stage need not run again."""
    return {"model": model_record(source), "data": corpus.fingerprint,
            "data_settings": recorded_data(recipe.data), "seed": recipe.seed,
            "sft": recipe.sft.model_dump(),
            WHERE: {"data": None if recipe.data.uses_demo else recipe.data.path},
            **training_inputs(recipe.compute)}


def recorded_data(settings: DataSettings) -> dict:
    """The data settings that decide the result: not where the files are (the corpus is named by its
    bytes in ``data``, its path is under :data:`~slm_align.runs.WHERE`; the task file does not reach
    SFT)."""
    return settings.model_dump(exclude={"path", "tasks"})


class SFTStage:
    """Supervised fine-tuning as a :class:`~slm_align.runs.Stage`: LoRA (+ NEFTune) on
    transformers' Trainer."""

    name = STAGE
    keep = ("adapter", "tokenizer", "inputs.json", "log.jsonl")

    def __init__(self, recipe: Recipe, out: Path):
        require_library(recipe.tracking.report_to)
        self.recipe = recipe
        self.out = Path(out)
        self.compute = resolve_compute(recipe.compute, quantizable=True)
        check_trainer_device(self.compute)
        self.source = resolve_source(recipe.model.source)
        self.tokenizer = load_tokenizer(self.source, recipe.model.trust_remote_code)
        self.corpus = load_corpus(recipe.data, recipe.seed)
        self.world = trainer_world(self.compute)

    def inputs(self) -> dict:
        return sft_inputs(self.recipe, self.source, self.corpus)

    def setup(self) -> None:
        """The encoded documents and the model with a fresh LoRA."""
        recipe = self.recipe
        self.train_rows = encode_all(self.corpus.splits.train, self.tokenizer,
                                     recipe.data.max_length)
        self.eval_rows = encode_all(self.corpus.splits.eval, self.tokenizer, recipe.data.max_length)
        if not self.train_rows or not self.eval_rows:
            raise UserError(f"data {self.corpus.description}: no document has text left to "
                            "train on after tokenizing")
        model = load_model(self.source, recipe.model.trust_remote_code, recipe.model.allow_pickle,
                           self.compute.quantization_config())
        self.model = attach_lora(trainable_base(model, self.compute), recipe.sft.lora, recipe.seed)

    def train(self, partial: Path, checkpoint: Optional[str]) -> None:
        from transformers import Trainer

        recipe = self.recipe
        self.checkpoint = checkpoint
        self.progress, tracker = trainer_logging(recipe, self.out, STAGE, partial, checkpoint,
                                                 self.world, "sft")
        args = training_arguments(recipe.sft, recipe.seed, partial, self.compute, tracker,
                                  eval_strategy="epoch",
                                  neftune_noise_alpha=recipe.sft.neftune_alpha or None)
        pad_id = self.tokenizer.pad_token_id
        trainer = make_trainer(Trainer, self.model, args, self.train_rows,
                               functools.partial(pad_batch, pad_id=pad_id), self.progress,
                               eval_dataset=self.eval_rows)
        try:
            self.output = trainer.train(resume_from_checkpoint=checkpoint)
            self.final_eval = self.progress.final_evaluation(trainer, self.output.global_step)
            self.progress.finish()
        finally:
            finish_trainer_tracking(trainer, tracker)

    def save(self, partial: Path) -> Optional[dict]:
        """The adapter and tokenizer (rank 0), and the metrics; every rank reports its
        weights' digest first."""
        replicas = replica_record(self.world, self.model)
        if not self.world.main:
            return None
        save_adapter(self.model, partial / "adapter")
        save_tokenizer(self.tokenizer, self.source, partial / "tokenizer")
        splits = self.corpus.splits
        return {"train_loss": self.output.training_loss, "eval_loss": self.final_eval["eval_loss"],
                "eval_loss_per_epoch": self.progress.eval_losses, "steps": self.output.global_step,
                "train_documents": len(self.train_rows), "eval_documents": len(self.eval_rows),
                "heldout_prompts": len(splits.heldout), "resumed_from": self.checkpoint,
                "trainable_parameters": sum(p.numel() for p in self.model.parameters()
                                            if p.requires_grad),
                "compute": self.compute.record(), **replicas}


def run_sft(recipe: Recipe, out: Path, resume: bool = False) -> StageResult:
    """Train the SFT adapter into ``out/sft`` (or return the existing one made
    from the same inputs)."""
    return run_stage(SFTStage(recipe, out), out, resume)
