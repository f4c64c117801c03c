"""Supervised fine-tuning: LoRA (peft) with NEFTune noise on transformers' Trainer, in float32 on CPU.

Output, under ``OUT/sft/``: ``adapter/`` (peft), ``tokenizer/``, ``log.jsonl`` and ``manifest.json``. The stage
works in ``OUT/sft.partial/`` (with Trainer checkpoints for ``--resume``) and is renamed into place only when
complete, so a crash never leaves an ``sft/`` that looks whole.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from slm_align.accelerator import check_trainer_device, resolve_compute, training_inputs
from slm_align.config import DataSettings, Recipe
from slm_align.data.corpus import Corpus, load_corpus
from slm_align.data.encoding import encode_all, pad_batch
from slm_align.errors import UserError
from slm_align.modeling import (
    ModelSource,
    attach_lora,
    load_model,
    load_tokenizer,
    resolve_source,
    save_adapter,
    save_tokenizer,
)
from slm_align.runs import StageResult, completed, make_manifest, publish, read_manifest
from slm_align.tracking import finish_trainer_tracking, require_library
from slm_align.training import make_trainer, start_trainer_run, trainable_base, training_arguments

STAGE = "sft"


def sft_inputs(recipe: Recipe, source: ModelSource, corpus: Corpus) -> dict:
    """Everything that decides the SFT result; equal inputs mean the stage need not run again."""
    return {"model": {"kind": source.kind, "ref": source.ref}, "data": corpus.fingerprint,
            "data_settings": recorded_data(recipe.data), "seed": recipe.seed, "sft": recipe.sft.model_dump(),
            **training_inputs(recipe.compute)}


def recorded_data(settings: DataSettings) -> dict:
    """The data settings as a manifest records them: the demo with one spelling (unset, as runs recorded it before
    ``--data demo``), so ``--data demo`` and a library caller's unset path reuse the same SFT stage."""
    recorded = settings.model_dump()
    if settings.uses_demo:
        recorded["path"] = None
    return recorded


def run_sft(recipe: Recipe, out: Path, resume: bool = False) -> StageResult:
    """Train the SFT adapter into ``out/sft`` (or return the existing one made from the same inputs)."""
    from transformers import Trainer

    started = time.time()
    require_library(recipe.tracking.report_to)
    compute = resolve_compute(recipe.compute, quantizable=True)
    check_trainer_device(compute)
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    corpus = load_corpus(recipe.data, recipe.seed)
    stage_dir = Path(out) / STAGE
    inputs = sft_inputs(recipe, source, corpus)
    done = completed(stage_dir, inputs)
    if done is not None:
        return StageResult(stage_dir, skipped=True, metrics=done["metrics"])
    train_rows = encode_all(corpus.splits.train, tokenizer, recipe.data.max_length)
    eval_rows = encode_all(corpus.splits.eval, tokenizer, recipe.data.max_length)
    if not train_rows or not eval_rows:
        raise UserError(f"data {corpus.description}: no document has text left to train on after tokenizing")
    model = load_model(source, recipe.model.trust_remote_code, recipe.model.allow_pickle,
                       compute.quantization_config())
    model = attach_lora(trainable_base(model, compute), recipe.sft.lora, recipe.seed)
    run = start_trainer_run(recipe, out, STAGE, stage_dir, inputs, resume, compute, "sft")
    partial = run.partial
    checkpoint = run.checkpoint
    progress = run.progress
    args = training_arguments(recipe.sft, recipe.seed, partial, compute, run.tracker, eval_strategy="epoch",
                              neftune_noise_alpha=recipe.sft.neftune_alpha or None)
    trainer = make_trainer(Trainer, model, args, train_rows, lambda rows: pad_batch(rows, tokenizer.pad_token_id),
                           progress, eval_dataset=eval_rows)
    try:
        train_output = trainer.train(resume_from_checkpoint=checkpoint)
        final_eval = trainer.evaluate()
    finally:
        finish_trainer_tracking(trainer, run.tracker)
    replicas = run.replicas(model)
    if not run.world.main:  # the other ranks of a data-parallel run: rank 0 publishes
        run.world.barrier()
        return StageResult(stage_dir, skipped=False, metrics={}, primary=False)
    save_adapter(model, partial / "adapter")
    save_tokenizer(tokenizer, source, partial / "tokenizer")
    metrics = {"train_loss": train_output.training_loss, "eval_loss": final_eval["eval_loss"],
               "eval_loss_per_epoch": progress.eval_losses, "steps": train_output.global_step,
               "train_documents": len(train_rows), "eval_documents": len(eval_rows),
               "heldout_prompts": len(corpus.splits.heldout), "resumed_from": checkpoint,
               "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
               "compute": compute.record(), **replicas}
    publish(partial, stage_dir, make_manifest(STAGE, inputs, metrics, started),
            keep=("adapter", "tokenizer", "inputs.json", "log.jsonl"))
    run.world.barrier()
    return StageResult(stage_dir, skipped=False, metrics=metrics)


def recipe_from_sft(run: Path, recipe: Recipe) -> tuple[Recipe, Path]:
    """The recipe (model, seed, data unless the user names other data) and adapter of a run's finished SFT."""
    manifest = read_manifest(Path(run) / STAGE)
    if manifest is None:
        raise UserError(f"run {run} has no finished SFT stage (no sft/manifest.json); run `slm-align sft --out {run}`")
    inputs = manifest["inputs"]
    updated = recipe.model_copy(deep=True)
    updated.model.source = inputs["model"]["ref"]
    updated.seed = inputs["seed"]
    if recipe.data.path is None:  # the run's own corpus and split, unless the user names other data
        updated.data = type(recipe.data).model_validate(inputs["data_settings"])
        updated.data.tasks = recipe.data.tasks  # RL's task file is not SFT's: the user's choice stands
    return updated, Path(run) / STAGE / "adapter"


def sft_prior(recipe: Recipe, out: Path, sft_from: Optional[Path], resume: bool, say) -> tuple[Recipe, Path]:
    """The SFT prior a later stage starts from: ``sft_from``'s finished SFT, or this run's (trained first when it
    is missing); returns the SFT recipe and adapter."""
    sft_run = Path(sft_from) if sft_from is not None else Path(out)
    if read_manifest(sft_run / STAGE) is None:
        if sft_from is not None:
            raise UserError(f"--sft {sft_from} has no finished SFT stage (no sft/manifest.json)")
        say("running SFT first (no sft/ in the run)")
        run_sft(recipe, out, resume=resume)
    return recipe_from_sft(sft_run, recipe)
