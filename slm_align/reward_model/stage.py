"""The reward stage: preference pairs -> Bradley-Terry reward model in ``OUT/reward/``.

Artifacts: ``model/`` (merged classifier + tokenizer, loads alone), ``pairs.jsonl`` and
``eval_pairs.jsonl`` (TRL columns plus the corruption ``kind``), ``log.jsonl`` and
``manifest.json`` with held-out accuracy.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Optional

from slm_align.config import Recipe
from slm_align.config.from_sft import recipe_from_sft
from slm_align.data.corpus import load_corpus
from slm_align.data.pairs import Pair, synthetic_pairs
from slm_align.data.preferences import read_preferences
from slm_align.envelope.trainer import (
    make_trainer,
    replica_record,
    trainer_logging,
    trainer_world,
    training_arguments,
)
from slm_align.errors import UserError
from slm_align.modeling.accelerator import check_trainer_device, resolve_compute, training_inputs
from slm_align.modeling.models import (
    attach_lora,
    load_tokenizer,
    merged_policy,
    resolve_source,
    save_tokenizer,
)
from slm_align.progress import stage_lines
from slm_align.runs import StageResult, digest, read_manifest, run_stage
from slm_align.scoring.reward_model import (
    bradley_terry_loss,
    classifier_from_policy,
    collate_pairs,
    encode_scored,
    pairwise_metrics,
    sequence_rewards,
)
from slm_align.tracking import finish_trainer_tracking

STAGE = "reward"


def _held_out(pair: Pair, seed: int) -> bool:
    """About one imported pair in ten is kept for measuring accuracy, chosen by
    a seeded content hash."""
    key = f"{seed}\x00{pair.prompt}\x00{pair.chosen}\x00{pair.rejected}".encode()
    return hashlib.sha256(key).digest()[0] < 26


def build_pairs(recipe: Recipe, tokenizer) -> tuple[list[Pair], list[Pair], dict]:
    """Training pairs (from training items only, plus imported ones) and
    held-out pairs for accuracy."""
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
        raise UserError(f"no preference pairs to train on: {cause} and no "
                        "--preferences file was given")
    if not held:
        raise UserError("no held-out preference pairs to measure accuracy on; give a larger corpus "
                        "or more preference rows")
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
    :func:`classifier_from_policy`). The policy is dropped as soon as the classifier holds what it
    needs, so what it does not take (an untied output projection: vocabulary x hidden floats) is
    freed before training rather than kept alive until the stage returns; tied embeddings stay,
    shared with the classifier."""
    policy = merged_policy(source, adapter, recipe.model.trust_remote_code,
                           recipe.model.allow_pickle)
    classifier = classifier_from_policy(policy, pad_token_id)
    del policy
    return attach_lora(classifier, recipe.reward.lora, recipe.seed, task_type="SEQ_CLS")


class RewardStage:
    """The Bradley-Terry reward model as a :class:`~slm_align.runs.Stage`, trained
    on the run's SFT prior."""

    name = STAGE
    keep = ("model", "pairs.jsonl", "eval_pairs.jsonl", "inputs.json", "log.jsonl")

    def __init__(self, recipe: Recipe, out: Path):
        """The run's SFT recipe and adapter (its SFT stage must be finished) and
        the pairs to train on."""
        self.out = Path(out)
        self.compute = resolve_compute(recipe.compute)
        check_trainer_device(self.compute)
        self.recipe, self.adapter = recipe_from_sft(self.out, recipe)
        self.source = resolve_source(self.recipe.model.source)
        self.tokenizer = load_tokenizer(self.source, self.recipe.model.trust_remote_code)
        self.train_pairs, self.held_pairs, self.pair_stats = build_pairs(self.recipe, self.tokenizer)
        self.world = trainer_world(self.compute)

    def inputs(self) -> dict:
        recipe = self.recipe
        pairs = self.train_pairs + self.held_pairs
        return {"sft": read_manifest(self.out / "sft")["inputs_hash"], "seed": recipe.seed,
                "reward": recipe.reward.model_dump(), "pairs": digest([p.to_row() for p in pairs]),
                **training_inputs(recipe.compute)}

    def setup(self) -> None:
        """The classifier (LoRA attached) and the encoded training pairs."""
        recipe = self.recipe
        self.model = _classifier(recipe, self.source, self.adapter, self.tokenizer.pad_token_id)
        max_length = recipe.data.max_length
        self.rows = [{"chosen_ids": encode_scored(self.tokenizer, p.prompt, p.chosen, max_length),
                      "rejected_ids": encode_scored(self.tokenizer, p.prompt, p.rejected,
                                                    max_length)}
                     for p in self.train_pairs]

    def train(self, partial: Path, checkpoint: Optional[str]) -> None:
        recipe = self.recipe
        self.checkpoint = checkpoint
        progress, tracker = trainer_logging(recipe, self.out, STAGE, partial, checkpoint,
                                            self.world, "reward model")
        trainer_class = _bt_trainer_class(recipe.reward.margin, recipe.reward.center_coefficient)
        args = training_arguments(recipe.reward, recipe.seed, partial, self.compute, tracker)
        collate = functools.partial(collate_pairs, pad_id=self.tokenizer.pad_token_id)
        trainer = make_trainer(trainer_class, self.model, args, self.rows, collate, progress)
        try:
            self.output = trainer.train(resume_from_checkpoint=checkpoint)
            progress.finish()
        finally:
            finish_trainer_tracking(trainer, tracker)

    def save(self, partial: Path) -> Optional[dict]:
        """The merged classifier with its tokenizer, the pairs, and held-out accuracy (rank 0)."""
        replicas = replica_record(self.world, self.model)
        if not self.world.main:
            return None
        merged = self.model.merge_and_unload().eval()
        merged.save_pretrained(partial / "model", safe_serialization=True)
        save_tokenizer(self.tokenizer, self.source, partial / "model")
        _write_jsonl(partial / "pairs.jsonl", self.train_pairs)
        _write_jsonl(partial / "eval_pairs.jsonl", self.held_pairs)
        with stage_lines("reward model evaluation", f"{len(self.held_pairs)} "
                                                    "held-out pairs") as stage:
            metrics = pairwise_metrics(merged, self.tokenizer, self.held_pairs,
                                       self.recipe.data.max_length)
            stage.figures = f"accuracy {metrics['accuracy']:.3f}"
        metrics.update(train_loss=self.output.training_loss, steps=self.output.global_step,
                       train_pairs=len(self.train_pairs), pair_stats=self.pair_stats,
                       resumed_from=self.checkpoint, compute=self.compute.record(), **replicas)
        return metrics


def run_reward(recipe: Recipe, out: Path, resume: bool = False) -> StageResult:
    """Train the reward model of run ``out`` (whose SFT stage must be finished)."""
    return run_stage(RewardStage(recipe, out), out, resume)
