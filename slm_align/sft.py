"""Supervised fine-tuning: LoRA (peft) with NEFTune noise on transformers' Trainer, in float32 on CPU.

Output, under ``OUT/sft/``: ``adapter/`` (peft), ``tokenizer/``, ``log.jsonl`` and ``manifest.json``. The stage
works in ``OUT/sft.partial/`` (with Trainer checkpoints for ``--resume``) and is renamed into place only when
complete, so a crash never leaves an ``sft/`` that looks whole.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slm_align.config import Recipe
from slm_align.data.corpus import Corpus, load_corpus
from slm_align.data.encoding import encode_all, pad_batch
from slm_align.errors import UserError
from slm_align.modeling import ModelSource, load_model, load_tokenizer, lora_targets, resolve_source
from slm_align.progress import TrainerProgress
from slm_align.runs import completed, digest, make_manifest, partial_dir, publish, write_json_atomic

STAGE = "sft"


@dataclass(frozen=True)
class SFTResult:
    """Where the stage's artifacts are, whether it was skipped as already done, and its metrics."""

    stage_dir: Path
    skipped: bool
    metrics: dict


def sft_inputs(recipe: Recipe, source: ModelSource, corpus: Corpus) -> dict:
    """Everything that decides the SFT result; equal inputs mean the stage need not run again."""
    return {"model": {"kind": source.kind, "ref": source.ref}, "data": corpus.fingerprint,
            "data_settings": recipe.data.model_dump(), "seed": recipe.seed, "sft": recipe.sft.model_dump()}


def _prepare_partial(partial: Path, inputs: dict, resume: bool) -> Optional[str]:
    """Create the work dir, or check a leftover one; returns the checkpoint to resume from."""
    from transformers.trainer_utils import get_last_checkpoint

    marker = partial / "inputs.json"
    if partial.exists():
        if not resume:
            raise UserError(f"an interrupted SFT run is in {partial}; pass --resume to continue it, "
                            "or remove that directory to start over")
        if not marker.is_file() or json.loads(marker.read_text())["inputs_hash"] != digest(inputs):
            raise UserError(f"{partial} was started with other inputs or settings; cannot resume it with these")
        checkpoints = partial / "checkpoints"
        return get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    partial.mkdir(parents=True)
    write_json_atomic(marker, {"inputs_hash": digest(inputs), "inputs": inputs})
    return None


def _training_args(recipe: Recipe, partial: Path):
    from transformers import TrainingArguments

    sft = recipe.sft
    return TrainingArguments(
        output_dir=str(partial / "checkpoints"), num_train_epochs=sft.epochs, max_steps=sft.max_steps,
        per_device_train_batch_size=sft.batch_size, per_device_eval_batch_size=sft.batch_size,
        gradient_accumulation_steps=sft.grad_accum, learning_rate=sft.learning_rate, lr_scheduler_type="cosine",
        warmup_ratio=sft.warmup_ratio, weight_decay=sft.weight_decay,
        neftune_noise_alpha=sft.neftune_alpha or None, eval_strategy="epoch", save_strategy="steps",
        save_steps=sft.save_steps, save_total_limit=2, logging_steps=10, use_cpu=True, seed=recipe.seed,
        data_seed=recipe.seed, report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, save_safetensors=True,
    )


def attach_lora(model, recipe: Recipe):
    """Wrap ``model`` with a fresh LoRA adapter configured by ``recipe.sft.lora``."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    lora = recipe.sft.lora
    set_seed(recipe.seed)
    targets = lora_targets(model.config.model_type, lora.target_modules)
    try:
        return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as exc:
        raise UserError(f"LoRA target modules {targets} do not match this model ({exc}); "
                        "name existing modules with --lora-targets") from None


def run_sft(recipe: Recipe, out: Path, resume: bool = False) -> SFTResult:
    """Train the SFT adapter into ``out/sft`` (or return the existing one made from the same inputs)."""
    from transformers import PrinterCallback, Trainer

    started = time.time()
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    corpus = load_corpus(recipe.data, recipe.seed)
    stage_dir = Path(out) / STAGE
    inputs = sft_inputs(recipe, source, corpus)
    done = completed(stage_dir, inputs)
    if done is not None:
        return SFTResult(stage_dir, skipped=True, metrics=done["metrics"])
    train_rows = encode_all(corpus.splits.train, tokenizer, recipe.data.max_length)
    eval_rows = encode_all(corpus.splits.eval, tokenizer, recipe.data.max_length)
    if not train_rows or not eval_rows:
        raise UserError(f"data {corpus.description}: no document has text left to train on after tokenizing")
    model = attach_lora(load_model(source, recipe.model.trust_remote_code, recipe.model.allow_pickle), recipe)
    partial = partial_dir(stage_dir)
    checkpoint = _prepare_partial(partial, inputs, resume)
    progress = TrainerProgress("sft", partial / "log.jsonl")
    trainer = Trainer(model=model, args=_training_args(recipe, partial), train_dataset=train_rows,
                      eval_dataset=eval_rows, data_collator=lambda rows: pad_batch(rows, tokenizer.pad_token_id),
                      callbacks=[progress])
    trainer.remove_callback(PrinterCallback)  # our progress bar and log.jsonl replace its stdout dicts
    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    final_eval = trainer.evaluate()
    with warnings.catch_warnings():  # peft warns when the base came from a .gguf or the bundled dir: harmless
        warnings.filterwarnings("ignore", message="Could not find a config file")
        model.save_pretrained(partial / "adapter", safe_serialization=True)
    tokenizer.save_pretrained(partial / "tokenizer")
    metrics = {"train_loss": train_output.training_loss, "eval_loss": final_eval["eval_loss"],
               "eval_loss_per_epoch": progress.eval_losses, "steps": train_output.global_step,
               "train_documents": len(train_rows), "eval_documents": len(eval_rows),
               "heldout_prompts": len(corpus.splits.heldout), "resumed_from": checkpoint,
               "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    publish(partial, stage_dir, make_manifest(STAGE, inputs, metrics, started),
            keep=("adapter", "tokenizer", "inputs.json", "log.jsonl"))
    return SFTResult(stage_dir, skipped=False, metrics=metrics)
