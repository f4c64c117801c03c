"""The reward stage: preference pairs -> Bradley-Terry reward model in ``OUT/reward/``.

Artifacts: ``model/`` (merged classifier + tokenizer, loads alone), ``pairs.jsonl`` and ``eval_pairs.jsonl``
(TRL columns plus the corruption ``kind``), ``log.jsonl`` and ``manifest.json`` with held-out accuracy.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from slm_align.accelerator import check_trainer_device, resolve_compute, training_inputs
from slm_align.config import Recipe
from slm_align.data.corpus import load_corpus
from slm_align.data.pairs import Pair, synthetic_pairs
from slm_align.data.preferences import read_preferences
from slm_align.errors import UserError
from slm_align.modeling import attach_lora, load_tokenizer, merged_policy, resolve_source, save_tokenizer
from slm_align.reward.model import (
    bradley_terry_loss,
    classifier_from_policy,
    collate_pairs,
    encode_scored,
    pairwise_metrics,
    sequence_rewards,
)
from slm_align.runs import StageResult, completed, digest, make_manifest, publish, read_manifest
from slm_align.sft import recipe_from_sft
from slm_align.tracking import finish_trainer_tracking
from slm_align.training import make_trainer, start_trainer_run, training_arguments

STAGE = "reward"


def _held_out(pair: Pair, seed: int) -> bool:
    """About one imported pair in ten is kept for measuring accuracy, chosen by a seeded content hash."""
    key = f"{seed}\x00{pair.prompt}\x00{pair.chosen}\x00{pair.rejected}".encode()
    return hashlib.sha256(key).digest()[0] < 26


def build_pairs(recipe: Recipe, tokenizer) -> tuple[list[Pair], list[Pair], dict]:
    """Training pairs (from training items only, plus imported ones) and held-out pairs for accuracy."""
    settings = recipe.reward
    train: list[Pair] = []
    held: list[Pair] = []
    stats: dict = {}
    if settings.pairs.synthetic:
        splits = load_corpus(recipe.data, recipe.seed).splits
        train, made = synthetic_pairs(splits.train, settings.pairs, recipe.seed)
        held, held_stats = synthetic_pairs(splits.eval, settings.pairs, recipe.seed + 1)
        stats = {"synthetic": made.to_dict(), "eval": held_stats.to_dict()}
    if settings.preferences:
        imported = read_preferences([Path(path) for path in settings.preferences], tokenizer)
        train += [p for p in imported if not _held_out(p, recipe.seed)]
        held += [p for p in imported if _held_out(p, recipe.seed)]
        stats["imported"] = len(imported)
    if not train:
        cause = ("the corpus gave none (documents too short to split)" if settings.pairs.synthetic
                 else "--no-synthetic-pairs is set")
        raise UserError(f"no preference pairs to train on: {cause} and no --preferences file was given")
    if not held:
        raise UserError("no held-out preference pairs to measure accuracy on; give a larger corpus or more "
                        "preference rows")
    return train, held, stats


def _bt_trainer_class(margin: float, center: float):
    from transformers import Trainer

    class BradleyTerryTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            rewards = sequence_rewards(model, inputs["input_ids"], inputs["attention_mask"])
            chosen, rejected = rewards.chunk(2)
            loss = bradley_terry_loss(chosen, rejected, margin, center)
            return (loss, {"rewards": rewards}) if return_outputs else loss

    return BradleyTerryTrainer


def _write_jsonl(path: Path, pairs: list[Pair]) -> None:
    path.write_text("".join(json.dumps(p.to_row()) + "\n" for p in pairs), encoding="utf-8")


def _classifier(recipe: Recipe, source, adapter, pad_token_id: int):
    """The classifier to train (LoRA attached), on the merged SFT policy's own tensors (see
    :func:`classifier_from_policy`). The policy is dropped as soon as the classifier holds what it needs, so what
    it does not take (an untied output projection: vocabulary x hidden floats) is freed before training rather than
    kept alive until the stage returns; tied embeddings stay, shared with the classifier."""
    policy = merged_policy(source, adapter, recipe.model.trust_remote_code, recipe.model.allow_pickle)
    classifier = classifier_from_policy(policy, pad_token_id)
    del policy
    return attach_lora(classifier, recipe.reward.lora, recipe.seed, task_type="SEQ_CLS")


def run_reward(recipe: Recipe, out: Path, resume: bool = False) -> StageResult:
    """Train the reward model of run ``out`` (whose SFT stage must be finished)."""
    started = time.time()
    compute = resolve_compute(recipe.compute)
    check_trainer_device(compute)
    recipe, adapter = recipe_from_sft(out, recipe)
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    train, held, pair_stats = build_pairs(recipe, tokenizer)
    stage_dir = Path(out) / STAGE
    inputs = {"sft": read_manifest(Path(out) / "sft")["inputs_hash"], "seed": recipe.seed,
              "reward": recipe.reward.model_dump(), "pairs": digest([p.to_row() for p in train + held]),
              **training_inputs(recipe.compute)}
    done = completed(stage_dir, inputs)
    if done is not None:
        return StageResult(stage_dir, skipped=True, metrics=done["metrics"])
    model = _classifier(recipe, source, adapter, tokenizer.pad_token_id)
    max_length = recipe.data.max_length
    rows = [{"chosen_ids": encode_scored(tokenizer, p.prompt, p.chosen, max_length),
             "rejected_ids": encode_scored(tokenizer, p.prompt, p.rejected, max_length)} for p in train]
    run = start_trainer_run(recipe, out, STAGE, stage_dir, inputs, resume, compute, "reward model")
    partial = run.partial
    checkpoint = run.checkpoint
    trainer = make_trainer(_bt_trainer_class(recipe.reward.margin, recipe.reward.center_coefficient), model,
                           training_arguments(recipe.reward, recipe.seed, partial, compute, run.tracker), rows,
                           lambda batch: collate_pairs(batch, tokenizer.pad_token_id), run.progress)
    try:
        output = trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        finish_trainer_tracking(trainer, run.tracker)
    replicas = run.replicas(model)
    if not run.world.main:  # the other ranks of a data-parallel run: rank 0 publishes
        run.world.barrier()
        return StageResult(stage_dir, skipped=False, metrics={}, primary=False)
    merged = model.merge_and_unload().eval()
    merged.save_pretrained(partial / "model", safe_serialization=True)
    save_tokenizer(tokenizer, source, partial / "model")
    _write_jsonl(partial / "pairs.jsonl", train)
    _write_jsonl(partial / "eval_pairs.jsonl", held)
    metrics = pairwise_metrics(merged, tokenizer, held, max_length)
    metrics.update(train_loss=output.training_loss, steps=output.global_step, train_pairs=len(train),
                   pair_stats=pair_stats, resumed_from=checkpoint, compute=compute.record(), **replicas)
    publish(partial, stage_dir, make_manifest(STAGE, inputs, metrics, started),
            keep=("model", "pairs.jsonl", "eval_pairs.jsonl", "inputs.json", "log.jsonl"))
    run.world.barrier()
    return StageResult(stage_dir, skipped=False, metrics=metrics)
