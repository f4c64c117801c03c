"""Fold a run's adapters into the base weights: a plain HF directory that loads without peft.

SFT adapter first (into the base), then the adapter of the run's latest aligned stage (RL,
DPO or KTO, each trained on top of the merged SFT weights). The output has safetensors
weights, the tokenizer with a chat template (ChatML when the model has none, recorded in the
manifest; a GGUF base's own tokenizer fields too, as ``tokenizer.gguf``), a generation
config, a model card (README.md, from the run's records) and ``manifest.json``. Written to
``OUT.partial`` and renamed when complete.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional

from slm_align.config import Recipe
from slm_align.config.from_sft import recipe_from_sft
from slm_align.errors import UserError
from slm_align.export.model_card import CARD, merged_card
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
    MANIFEST,
    StageResult,
    aligned_stages,
    check_out_dir,
    make_manifest,
    partial_dir,
    publish,
    read_manifest,
)

POLICY_STAGES = ("sft", *ALIGNED_STAGES)
"""The policies a run can be merged and exported as: the SFT prior, or an aligned stage on it."""


def merged_stage(run: Path, stage: Optional[str] = None) -> Optional[str]:
    """The aligned stage whose adapter a merge folds in: ``stage`` when given (None for ``sft``, the
    prior alone; a stage the run has not finished is refused in one line), else the run's most
    recently finished of RL, DPO and KTO (None: the SFT prior alone)."""
    if stage is None:
        stages = aligned_stages(run)
        return stages[-1] if stages else None
    if stage not in POLICY_STAGES:
        raise UserError(f"--stage {stage}: choose {', '.join(POLICY_STAGES)}")
    if stage == "sft":
        return None
    if stage not in aligned_stages(run):
        raise UserError(f"run {run} has no finished {stage} stage (no {stage}/adapter with its manifest); "
                        f"train it first, or choose --stage {' or '.join(['sft', *aligned_stages(run)])}")
    return stage


def merged_dir(run: Path, stage: Optional[str] = None) -> Path:
    """Where a run's merged policy lies: ``RUN/merged`` (the latest stage), or ``RUN/merged-STAGE``
    for a stage named, so that merges of different stages never replace each other."""
    return Path(run) / ("merged" if stage is None else f"merged-{stage}")


def merged_is_current(run: Path, stage: Optional[str] = None) -> bool:
    """Whether the merged directory of ``stage`` (:func:`merged_dir`) folds in the stage it should
    (for none named, the run's latest: a DPO round after an export makes it stale)."""
    merged = merged_dir(run, stage)
    manifest = read_manifest(merged)
    if manifest is None:
        return False
    aligned = merged_stage(run, stage)
    if manifest["inputs"].get("aligned_stage") != aligned:
        return False
    if aligned is None:
        return True
    return (merged / MANIFEST).stat().st_mtime_ns >= (run / aligned / MANIFEST).stat().st_mtime_ns


def current_merged(run: Path, stage: Optional[str] = None) -> Path:
    """The run's merged directory for ``stage`` (:func:`merged_dir`), merged anew (default recipe)
    unless it folds in what it should."""
    run = Path(run)
    if not merged_is_current(run, stage):
        from slm_align.config import load_recipe

        merge_run(load_recipe(None, {}), run, merged_dir(run, stage), overwrite=True, stage=stage)
    return merged_dir(run, stage)


def merge_run(recipe: Recipe, run: Path, out: Optional[Path] = None, overwrite: bool = False,
              stage: Optional[str] = None) -> StageResult:
    """Write ``out`` (default :func:`merged_dir`: ``run/merged``, or ``run/merged-STAGE``) from the
    run's base model, SFT adapter and the adapter of ``stage`` (``sft``: none; not given: the latest
    aligned stage, RL, DPO or KTO, if any). Both adapters are checked before anything loads (a
    pickle-only one needs ``model.allow_pickle``)."""
    started = time.time()
    device = resolve_device(recipe.compute.device)  # a device that is not there: refused before any work
    run = Path(run)
    aligned = merged_stage(run, stage)
    out = check_out_dir(Path(out) if out is not None else merged_dir(run, stage))
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it or choose another --out")
    recipe, sft_adapter = recipe_from_sft(run, recipe)
    adapters = [sft_adapter] + ([run / aligned / "adapter"] if aligned is not None else [])
    for adapter in adapters:
        require_adapter(adapter, recipe.model.allow_pickle)
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    model = merged_policy(source, sft_adapter, recipe.model.trust_remote_code, recipe.model.allow_pickle)
    model = model.to(device)
    if aligned is not None:
        model = load_adapter(model, run / aligned / "adapter", recipe.model.allow_pickle).merge_and_unload()
    default_template = tokenizer.chat_template is None
    if default_template:
        tokenizer.chat_template = default_chat_template(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    partial = partial_dir(out)
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    save_tokenizer(tokenizer, source, partial)
    inputs = {"base": source.ref, "sft_adapter": str(sft_adapter), "aligned_stage": aligned,
              "aligned_adapter": str(run / aligned / "adapter") if aligned is not None else None}
    metrics = {"parameters": sum(p.numel() for p in model.parameters()), "default_chat_template": default_template,
               "architecture": model.config.model_type, "model_card": CARD}
    (partial / CARD).write_text(merged_card(run, out.name, "sft" if aligned is None else aligned), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    publish(partial, out, make_manifest("merge", inputs, metrics, started))
    return StageResult(out, skipped=False, metrics=metrics)
