"""The DPO / KTO stage: the SFT prior, the preference files split by prompt, the gate, then guarded steps; artifacts
in ``OUT/dpo/`` or ``OUT/kto/``.

Artifacts: ``adapter/`` (the preference LoRA on top of the merged SFT weights), ``metrics.jsonl`` (one line per step,
held-out figures every ``eval_every`` steps), ``plots/training_curves.png`` and ``manifest.json`` (the gate, the
held-out figures before and after with intervals, which models the feedback was given to, guard totals).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from slm_align.accelerator import resolve_compute, training_inputs
from slm_align.atomic import atomic_path, write_json_atomic
from slm_align.config import Recipe
from slm_align.data.readers import fingerprint
from slm_align.envelope.policy import build_policy
from slm_align.envelope.world import launched
from slm_align.errors import UserError
from slm_align.headroom import Figure, GateRefused, HeadroomReport
from slm_align.modeling import load_tokenizer, resolve_source, save_adapter
from slm_align.plots import plot_curves
from slm_align.preference.algorithms import preference_learner
from slm_align.preference.data import PreferenceData, check_feedback_models, load_preference_data
from slm_align.preference.learner import PreferenceLearner
from slm_align.progress import new_progress, stage_lines
from slm_align.runs import (
    StageResult,
    completed,
    keep_first_lines,
    make_manifest,
    partial_dir,
    prepare_partial,
    publish,
    read_manifest,
)
from slm_align.sft import sft_prior
from slm_align.tracking import Tracker, open_tracker, require_library

ALGORITHMS = ("dpo", "kto")
CHECKPOINT = "checkpoint.pt"
HELDOUT_START = "heldout_start.json"
"""The held-out figures before the first step, kept for a resumed run's manifest."""
CURVES = ("loss", "accuracy", "margin", "kl", "reward/desirable", "reward/undesirable", "pair_accuracy",
          "label_accuracy", "grad_norm")


def run_preference(recipe: Recipe, out: Path, resume: bool = False, force: bool = False,
                   sft_from: Optional[Path] = None, say=lambda _: None) -> StageResult:
    """DPO or KTO (``recipe.rl.algo``) on ``recipe.reward.preferences`` from the run's SFT prior."""
    started = time.time()
    refuse_data_parallel(recipe.rl.algo)
    require_library(recipe.tracking.report_to)
    compute = resolve_compute(recipe.compute, trainer=False)
    out = Path(out)
    algo = recipe.rl.algo
    stage_dir = out / algo
    sft_recipe, adapter = sft_prior(recipe, out, sft_from, resume, say)
    recipe = sft_recipe.model_copy(update={"rl": recipe.rl, "preference": recipe.preference,
                                           "reward": recipe.reward})
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    paths = [Path(p) for p in recipe.reward.preferences]
    data = load_preference_data(paths, tokenizer, algo, recipe.seed, recipe.preference.heldout_fraction)
    feedback = check_feedback_models(data.model_ids, out, recipe.preference.any_model)
    inputs = _inputs(recipe, algo, adapter, paths)
    done = completed(stage_dir, inputs)
    if done is not None:
        return StageResult(stage_dir, skipped=True, metrics=done["metrics"])
    policy = build_policy(source, adapter, recipe.rl.model_copy(update={"lora": recipe.preference.lora}), recipe.seed,
                          recipe.model.trust_remote_code, recipe.model.allow_pickle, compute.device)
    heldout = len(data.heldout_pairs)
    with stage_lines(f"{algo} set-up", f"the reference's log-probabilities of {heldout} held-out pairs"):
        learner = preference_learner(policy, tokenizer, data, recipe.preference, algo, recipe.rl.envelope,
                                     recipe.seed, recipe.data.max_length, compute.precision,
                                     compute.gradient_checkpointing)
    gate = preference_gate(recipe, algo, data, learner).to_dict()
    say(f"{algo} gate: {gate['verdict']}" + (f" ({'; '.join(gate['reasons'])})" if gate["reasons"] else ""))
    if not gate["passed"] and not force:
        raise GateRefused(f"{algo} gate FAIL ({'; '.join(gate['reasons'])}): {' '.join(gate['remedies'])} "
                          "Pass --force to train anyway (recorded in the manifest).")
    partial = partial_dir(stage_dir)
    prepare_partial(partial, inputs, resume)
    resume_step = None
    if (partial / CHECKPOINT).is_file():
        learner.load_state_dict(torch.load(partial / CHECKPOINT, weights_only=True))
        resume_step = learner.step
    before = learner.heldout() if learner.step == 0 else _first_heldout(partial)
    tracker = open_tracker(recipe, out, algo, resume_step)
    try:
        _iterate(learner, partial, tracker)
    finally:
        tracker.close()
    after = learner.heldout()
    save_adapter(policy, partial / "adapter")
    plot_curves(partial / "metrics.jsonl", partial / "plots" / "training_curves.png", keys=CURVES)
    metrics = dict(_figures(learner, data, gate, before, after, feedback, adapter, force), compute=compute.record())
    publish(partial, stage_dir, make_manifest(algo, inputs, metrics, started),
            keep=("adapter", "metrics.jsonl", "plots", "inputs.json", HELDOUT_START))
    return StageResult(stage_dir, skipped=False, metrics=metrics)


def refuse_data_parallel(algo: str) -> None:
    """DPO and KTO train in one process: launched as one of several (WORLD_SIZE > 1), every rank would train the same
    steps into the same folder, so the launch is refused in one line before any work."""
    if launched():
        raise UserError(f"--algo {algo} trains in one process, and this one was launched as 1 of "
                        f"{os.environ['WORLD_SIZE']} (WORLD_SIZE); run it without accelerate launch or torchrun "
                        "(SFT, the reward model and PPO/GRPO take data parallel)")


def _inputs(recipe: Recipe, algo: str, adapter: Path, paths: list[Path]) -> dict:
    """What the stage's artifacts depend on (a completed stage with other inputs is never overwritten)."""
    return {"algo": algo, "sft": {"adapter": str(adapter), "inputs_hash": read_manifest(adapter.parent)["inputs_hash"]},
            "preferences": [fingerprint(path) for path in paths], "seed": recipe.seed,
            "preference": recipe.preference.model_dump(), "envelope": recipe.rl.envelope.model_dump(),
            "max_length": recipe.data.max_length, **training_inputs(recipe.compute)}


def preference_gate(recipe: Recipe, algo: str, data: PreferenceData, learner: PreferenceLearner) -> HeadroomReport:
    """The gate in front of DPO/KTO: enough training items, a held-out split to measure on, label balance (KTO),
    and a fluent prior (its perplexity on the held-out chosen completions below ``headroom.max_ppl``)."""
    settings = recipe.preference
    unit = "pairs" if algo == "dpo" else "labelled completions"
    heldout = len(learner.chosen.rows)
    heldout_name = "held-out pairs"
    if algo == "kto":
        heldout += len(learner.labelled.rows)
        heldout_name = "held-out pairs and labelled completions"
    figures = [Figure(f"training {unit}", learner.size(), settings.min_train, ">=",
                      "Collect more feedback (picks, edits, thumbs) or add TRL preference files."),
               Figure(heldout_name, heldout, settings.min_heldout, ">=",
                      "Add preferences on more prompts, or raise preference.heldout_fraction.")]
    if algo == "kto":
        figures.append(Figure("share of the rarer label", data.label_share(), settings.min_label_share, ">=",
                              "Collect more of the rarer verdict (thumbs up or down) before training KTO."))
    ppl = learner.prior_perplexity()
    info = {"prompts": data.prompts, "dropped_by_truncation": learner.dropped}
    if ppl is not None:
        figures.append(Figure("prior perplexity on held-out chosen answers", ppl, recipe.headroom.max_ppl, "<",
                              "Train SFT longer (or on text like the chosen answers) before preference tuning."))
    return HeadroomReport(figures, info)


def _first_heldout(partial: Path) -> dict:
    """The held-out figures measured before the first step of an interrupted run (saved for its resume)."""
    return json.loads((partial / HELDOUT_START).read_text(encoding="utf-8"))


def _iterate(learner: PreferenceLearner, partial: Path, tracker: Tracker) -> None:
    """The remaining steps: metrics appended per step (held-out figures every ``eval_every``) and reported to the
    tracker, checkpoints every ``save_steps`` and at the end."""
    settings = learner.settings
    metrics_path = partial / "metrics.jsonl"
    keep_first_lines(metrics_path, learner.step)  # steps after the checkpoint are trained again
    if learner.step == 0:
        write_json_atomic(partial / HELDOUT_START, learner.heldout())
    with new_progress() as progress:
        task = progress.add_task(learner.algo.upper(), total=settings.steps, completed=learner.step, status="")
        while learner.step < settings.steps:
            metrics = learner.train_step()
            if learner.step % settings.eval_every == 0 or learner.step == settings.steps:
                metrics.update({f"heldout/{k}": v for k, v in learner.heldout().items() if not k.endswith("_ci")})
            progress.update(task, completed=learner.step, status=f"loss {metrics.get('loss', float('nan')):.3f}")
            with open(metrics_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(metrics) + "\n")
            tracker.log(learner.step, metrics)
            if learner.step % settings.save_steps == 0 or learner.step == settings.steps:
                with atomic_path(partial / CHECKPOINT) as tmp:
                    torch.save(learner.state_dict(), tmp)


def _figures(learner: PreferenceLearner, data: PreferenceData, gate: dict, before: dict, after: dict, feedback: dict,
             adapter: Path, force: bool) -> dict:
    """The manifest's metrics: held-out figures before and after, the gate, the feedback's models, the guards."""
    counters = learner.guard.counters
    return {"algo": learner.algo, "steps": learner.step, "learning_rate": learner.learning_rate,
            "train_items": learner.size(), "heldout_pairs": len(learner.chosen.rows),
            "heldout_labelled": len(learner.labelled.rows), "dropped_by_truncation": learner.dropped,
            "desirable_weight": learner.desirable_weight if learner.algo == "kto" else None,
            "heldout_before": before, "heldout_after": after, "heldout_accuracy": _accuracy(after),
            "gate": {"verdict": gate["verdict"], "forced": bool(force and not gate["passed"]),
                     "reasons": gate["reasons"], "figures": gate["figures"]},
            "guard": {"rollbacks": counters.rollbacks}, "feedback_models": feedback, "sft_adapter": str(adapter)}


def _accuracy(figures: dict) -> Optional[dict]:
    """The headline held-out accuracy: on pairs when there are any, else on labelled completions (KTO)."""
    for key in ("pair_accuracy", "label_accuracy"):
        if key in figures:
            return {"kind": key, "value": figures[key], "ci95": list(figures[f"{key}_ci"])}
    return None
