"""Fold a run's adapters into the base weights: a plain HF directory that loads without peft.

SFT adapter first (into the base), then the adapter of the run's latest aligned stage (RL, DPO or
KTO, each trained on top of the merged SFT weights). The output has safetensors weights, the
tokenizer with a chat template (ChatML when the model has none, recorded in the manifest; a GGUF
base's own tokenizer fields too, as ``tokenizer.gguf``), a generation config, a model card
(README.md, from the run's records) and ``manifest.json``. Written to a scratch folder beside
``OUT`` and renamed when complete (:func:`~slm_align.runs.publish_artifact`); an existing merge is
reused by one rule, its recorded inputs hash (the stages folded in, by content)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from slm_align.config import Recipe
from slm_align.config.from_sft import recipe_from_sft
from slm_align.errors import UserError
from slm_align.export.publishing.model_card import CARD, merged_card
from slm_align.modeling.accelerator import resolve_device
from slm_align.modeling.models import (
    load_adapter,
    load_tokenizer,
    merged_policy,
    require_adapter,
    resolve_source,
    save_tokenizer,
)
from slm_align.ondevice.templates.chat import default_chat_template
from slm_align.runs import (
    ALIGNED_STAGES,
    LAST_ADAPTER,
    RL_LAST,
    Artifact,
    StageResult,
    aligned_stages,
    check_out_dir,
    policy_adapter,
    policy_stage,
    publish_artifact,
    stage_identity,
)

POLICY_STAGES = ("sft", *ALIGNED_STAGES, RL_LAST)
"""The policies a run can be merged and exported as: the SFT prior, an aligned stage on it, or the RL stage's last
iteration (where the watchdog published an earlier one)."""


def merged_stage(run: Path, stage: Optional[str] = None) -> Optional[str]:
    """The aligned policy whose adapter a merge folds in: ``stage`` when given (None for ``sft``, the
    prior alone; ``rl-last``, the RL stage's last iteration; a stage the run has not finished is refused in one
    line), else the run's most recently finished of RL, DPO and KTO (None: the SFT prior alone)."""
    if stage is None:
        stages = aligned_stages(run)
        return stages[-1] if stages else None
    if stage not in POLICY_STAGES:
        raise UserError(f"--stage {stage}: choose {', '.join(POLICY_STAGES)}")
    if stage == "sft":
        return None
    finished = aligned_stages(run)
    if policy_stage(stage) not in finished:
        raise UserError(f"run {run} has no finished {policy_stage(stage)} stage (no {policy_stage(stage)}/adapter "
                        "with its manifest); train it first, or choose --stage "
                        f"{' or '.join(['sft', *finished])}")
    if not policy_adapter(run, stage).is_dir():
        raise UserError(f"run {run} kept no rl/{LAST_ADAPTER} (the watchdog keeps it; with --watchdog off "
                        "rl/adapter is the last iteration's): choose --stage rl")
    return stage


def merged_dir(run: Path, stage: Optional[str] = None) -> Path:
    """Where a run's merged policy lies: ``RUN/merged`` (the latest stage), or ``RUN/merged-STAGE``
    for a stage named, so that merges of different stages never replace each other."""
    return Path(run) / ("merged" if stage is None else f"merged-{stage}")


def policy_identity(run: Path, aligned: Optional[str]) -> dict:
    """What a run's policy is made of, by content: the identity
    (:func:`~slm_align.runs.stage_identity`) of its SFT stage and of the aligned stage folded in, so
    that a stage trained again makes its merge and exports stale while a file merely touched does
    not."""
    stages = ["sft"] + ([aligned] if aligned is not None else [])
    return {name: stage_identity(Path(run) / policy_stage(name)) for name in stages}


def current_merged(run: Path, stage: Optional[str] = None) -> Path:
    """The run's merged directory for ``stage`` (:func:`merged_dir`), merged anew (default recipe)
    unless it was made from what it should fold in now (its recorded inputs hash)."""
    from slm_align.config import load_recipe

    run = Path(run)
    merge_run(load_recipe(None, {}), run, merged_dir(run, stage), overwrite=True, stage=stage,
              reuse=True)
    return merged_dir(run, stage)


class MergedModel(Artifact):
    """The run's base with its SFT adapter and the aligned stage's folded in, as a plain HF
    directory."""

    stage = "merge"

    def __init__(self, recipe: Recipe, run: Path, out: Path, aligned: Optional[str],
                 started: float):
        self.run, self.final, self.aligned, self.started = run, out, aligned, started
        self.recipe, self.sft_adapter = recipe_from_sft(run, recipe)
        self.adapters = [self.sft_adapter]
        if aligned is not None:
            self.adapters.append(policy_adapter(run, aligned))
        self.source = resolve_source(self.recipe.model.source)

    def inputs(self) -> dict:
        aligned_adapter = str(self.adapters[1]) if self.aligned is not None else None
        return {"base": self.source.ref, "sft_adapter": str(self.sft_adapter),
                "aligned_stage": self.aligned, "aligned_adapter": aligned_adapter,
                "policy": policy_identity(self.run, self.aligned)}

    def build(self, scratch: Path) -> Path:
        """Both adapters checked before anything loads (a pickle-only one needs
        ``model.allow_pickle``)."""
        model_settings = self.recipe.model
        for adapter in self.adapters:
            require_adapter(adapter, model_settings.allow_pickle)
        tokenizer = load_tokenizer(self.source, model_settings.trust_remote_code)
        model = merged_policy(self.source, self.sft_adapter, model_settings.trust_remote_code,
                              model_settings.allow_pickle)
        model = model.to(resolve_device(self.recipe.compute.device))
        if self.aligned is not None:
            aligned = load_adapter(model, self.adapters[1], model_settings.allow_pickle)
            model = aligned.merge_and_unload()
        self.default_template = tokenizer.chat_template is None
        if self.default_template:
            tokenizer.chat_template = default_chat_template(tokenizer)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(scratch, safe_serialization=True)
        save_tokenizer(tokenizer, self.source, scratch)
        self.model = model
        stage = "sft" if self.aligned is None else self.aligned
        card = merged_card(self.run, self.final.name, stage)
        (scratch / CARD).write_text(card, encoding="utf-8")
        return scratch

    def verify(self, built: Path) -> dict:
        model = self.model
        return {"parameters": sum(p.numel() for p in model.parameters()),
                "default_chat_template": self.default_template,
                "architecture": model.config.model_type, "model_card": CARD}


def merge_run(recipe: Recipe, run: Path, out: Optional[Path] = None, overwrite: bool = False,
              stage: Optional[str] = None, reuse: bool = False) -> StageResult:
    """Write ``out`` (default :func:`merged_dir`: ``run/merged``, or ``run/merged-STAGE``) from the
    run's base model, SFT adapter and the adapter of ``stage`` (``sft``: none; not given: the latest
    aligned stage, RL, DPO or KTO, if any). With ``reuse``, a merge there made from the same inputs
    (the same stages, by content) is kept as it is."""
    started = time.time()
    resolve_device(recipe.compute.device)  # a device that is not there: refused before any work
    run = Path(run)
    aligned = merged_stage(run, stage)
    out = check_out_dir(Path(out) if out is not None else merged_dir(run, stage))
    merged = MergedModel(recipe, run, out, aligned, started)
    return publish_artifact(merged, overwrite=overwrite, reuse=reuse)
