"""The DPO / KTO stage: the SFT prior, the preference files split by prompt, the gate, then guarded
steps; artifacts in ``OUT/dpo/`` or ``OUT/kto/``.

Artifacts: ``adapter/`` (the preference LoRA on top of the merged SFT weights), ``metrics.jsonl``
(one line per step, held-out figures every ``eval_every`` steps), ``plots/training_curves.png`` and
``manifest.json`` (the gate, the held-out figures before and after with intervals, which models the
feedback was given to, guard totals).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from slm_align.atomic import write_json_atomic
from slm_align.config import Recipe
from slm_align.data.readers import fingerprint
from slm_align.envelope.gate import Figure, GateRefused, HeadroomReport, refusal
from slm_align.envelope.loop import StepPlan, StepRecord, load_checkpoint, train_steps
from slm_align.envelope.policy import build_policy
from slm_align.envelope.run import Placement
from slm_align.envelope.world import World, launched
from slm_align.errors import UserError
from slm_align.modeling.accelerator import resolve_compute, training_inputs
from slm_align.modeling.models import load_tokenizer, resolve_source, save_adapter
from slm_align.plots import plot_curves
from slm_align.preference.algorithms import preference_algorithm
from slm_align.preference.data import PreferenceData, check_feedback_models, load_preference_data
from slm_align.preference.learner import PreferenceLearner
from slm_align.progress import quiet, stage_lines
from slm_align.runs import stage_identity
from slm_align.tracking import Tracker, open_tracker, require_library

HELDOUT_START = "heldout_start.json"
"""The held-out figures before the first step, kept for a resumed run's manifest."""
CURVES = ("loss", "accuracy", "margin", "kl", "reward/desirable", "reward/undesirable", "pair_accuracy",
          "label_accuracy", "grad_norm")


class PreferenceStage:
    """DPO or KTO (``recipe.rl.algo``) as a :class:`~slm_align.runs.Stage`: the preference files
    split by prompt, the reference's log-probabilities, the gate, guarded steps; held-out
    figures before and after."""

    keep = ("adapter", "metrics.jsonl", "plots", "inputs.json", HELDOUT_START)

    def __init__(self, recipe: Recipe, out: Path, adapter: Path, force: bool = False,
                 say: Callable[[str], None] = quiet):
        """``recipe`` is the SFT stage's (model, seed, data) with the preference settings;
        ``adapter`` its SFT adapter, the prior."""
        refuse_data_parallel(recipe.rl.algo)
        require_library(recipe.tracking.report_to)
        self.recipe = recipe
        self.algorithm = preference_algorithm(recipe.rl.algo)
        self.algo = recipe.rl.algo
        self.name = self.algo
        self.out = Path(out)
        self.adapter = Path(adapter)
        self.force = force
        self.say = say
        self.world = World()
        self.compute = resolve_compute(recipe.compute, trainer=False)
        self.source = resolve_source(recipe.model.source)
        self.tokenizer = load_tokenizer(self.source, recipe.model.trust_remote_code)
        self.paths = [Path(p) for p in recipe.reward.preferences]
        self.data = load_preference_data(self.paths, self.tokenizer, self.algo, recipe.seed,
                                         recipe.preference.heldout_fraction)
        self.feedback = check_feedback_models(self.data.model_ids, self.out,
                                              recipe.preference.any_model)

    def inputs(self) -> dict:
        """What the stage's artifacts depend on (the SFT prior named by its
        content, not its path)."""
        recipe = self.recipe
        return {"algo": self.algo, "sft": stage_identity(self.adapter.parent),
                "preferences": [fingerprint(path) for path in self.paths], "seed": recipe.seed,
                "preference": recipe.preference.model_dump(), "envelope": recipe.rl.envelope.model_dump(),
                "max_length": recipe.data.max_length, **training_inputs(recipe.compute)}

    def setup(self) -> None:
        """The policy (merged prior + fresh LoRA), the learner with the reference's
        held-out log-probabilities, and the gate, which refuses before any work dir
        exists unless ``force``."""
        recipe = self.recipe
        settings = recipe.rl.model_copy(update={"lora": recipe.preference.lora})
        self.policy = build_policy(self.source, self.adapter, settings, recipe.seed,
                                   recipe.model.trust_remote_code, recipe.model.allow_pickle,
                                   self.compute.device)
        heldout = len(self.data.heldout_pairs)
        placement = Placement(self.world, self.compute.precision,
                              self.compute.gradient_checkpointing)
        with stage_lines(f"{self.algo} set-up", "the reference's log-probabilities of "
                                                f"{heldout} held-out pairs"):
            self.learner = self.algorithm(self.policy, self.tokenizer, self.data,
                                          recipe.preference, recipe.rl.envelope, recipe.seed,
                                          recipe.data.max_length, placement)
        self.gate = preference_gate(recipe, self.data, self.learner).to_dict()
        gate = self.gate
        reasons = f" ({'; '.join(gate['reasons'])})" if gate["reasons"] else ""
        self.say(f"{self.algo} gate: {gate['verdict']}{reasons}")
        if not gate["passed"] and not self.force:
            raise GateRefused(refusal(f"{self.algo} gate", gate))

    def train(self, partial: Path, checkpoint: Optional[str]) -> None:
        """The remaining steps from the work dir's checkpoint (if any); held-out
        figures before and after."""
        learner = self.learner
        state = load_checkpoint(partial)
        resume_step = None
        if state is not None:
            learner.load_state_dict(state)
            resume_step = learner.step
        self.before = learner.heldout() if learner.step == 0 else _first_heldout(partial)
        tracker = open_tracker(self.recipe, self.out, self.algo, resume_step)
        try:
            _iterate(learner, partial, tracker)
        finally:
            tracker.close()
        self.after = learner.heldout()

    def save(self, partial: Path) -> dict:
        """The adapter and the training curves; the metrics."""
        save_adapter(self.policy, partial / "adapter")
        plot_curves(partial / "metrics.jsonl", partial / "plots" / "training_curves.png", keys=CURVES)
        figures = _figures(self.learner, self.data, self.gate, self.before, self.after, self.feedback, self.adapter,
                           self.force)
        return dict(figures, compute=self.compute.record())


def refuse_data_parallel(algo: str) -> None:
    """DPO and KTO train in one process: launched as one of several (WORLD_SIZE > 1),
    every rank would train the same steps into the same folder, so the launch is refused
    in one line before any work."""
    if launched():
        raise UserError(f"--algo {algo} trains in one process, and this one was launched as 1 of "
                        f"{os.environ['WORLD_SIZE']} (WORLD_SIZE); run it without accelerate launch or torchrun "
                        "(SFT, the reward model and PPO/GRPO take data parallel)")


def preference_gate(recipe: Recipe, data: PreferenceData,
                    learner: PreferenceLearner) -> HeadroomReport:
    """The gate in front of DPO/KTO: enough training items, a held-out split to measure on, the
    algorithm's balance figures (KTO: label balance), and a fluent prior (its perplexity on the
    held-out chosen completions below ``headroom.max_ppl``)."""
    settings = recipe.preference
    heldout_name, heldout = learner.heldout_count()
    figures = [Figure(f"training {learner.unit}", learner.size(), settings.min_train, ">=",
                      "Collect more feedback (picks, edits, thumbs) or add TRL preference files."),
               Figure(heldout_name, heldout, settings.min_heldout, ">=",
                      "Add preferences on more prompts, or raise preference.heldout_fraction.")]
    figures += learner.balance_figures(data, settings)
    ppl = learner.prior_perplexity()
    info = {"prompts": data.prompts, "dropped_by_truncation": learner.dropped}
    if ppl is not None:
        figures.append(Figure("prior perplexity on held-out chosen answers",
                              ppl, recipe.headroom.max_ppl, "<",
                              "Train SFT longer (or on text like the chosen answers) "
                              "before preference tuning."))
    return HeadroomReport(figures, info)


def _first_heldout(partial: Path) -> dict:
    """The held-out figures measured before the first step of an interrupted run
    (saved for its resume)."""
    return json.loads((partial / HELDOUT_START).read_text(encoding="utf-8"))


def _iterate(learner: PreferenceLearner, partial: Path, tracker: Tracker) -> None:
    """The remaining steps: held-out figures join a step's metrics every ``eval_every`` steps."""
    settings = learner.settings
    if learner.step == 0:
        write_json_atomic(partial / HELDOUT_START, learner.heldout())

    def step() -> dict:
        """One guarded DPO/KTO step (and the held-out figures when due)."""
        metrics = learner.train_step()
        if learner.step % settings.eval_every == 0 or learner.step == settings.steps:
            figures = learner.heldout().items()
            metrics.update({f"heldout/{k}": v for k, v in figures if not k.endswith("_ci")})
        return metrics

    plan = StepPlan(step, settings.steps, title=learner.algo.upper(), status=_loss_status)
    train_steps(learner, plan, StepRecord(partial, learner.state_dict, settings.save_steps, World(),
                                          tracker))


def _loss_status(metrics: dict) -> str:
    return f"loss {metrics.get('loss', float('nan')):.3f}"


def _figures(learner: PreferenceLearner, data: PreferenceData, gate: dict, before: dict,
             after: dict, feedback: dict, adapter: Path, force: bool) -> dict:
    """The manifest's metrics: held-out figures before and after, the gate, the
    feedback's models, the guards."""
    counters = learner.guard.counters
    gate_record = {"verdict": gate["verdict"], "forced": bool(force and not gate["passed"]),
                   "reasons": gate["reasons"], "figures": gate["figures"]}
    return {"algo": learner.algo, "steps": learner.step, "learning_rate": learner.learning_rate,
            "train_items": learner.size(), "heldout_pairs": len(learner.chosen.rows),
            "heldout_labelled": len(learner.labelled.rows),
            "dropped_by_truncation": learner.dropped,
            **learner.own_figures(),
            "heldout_before": before, "heldout_after": after, "heldout_accuracy": _accuracy(after),
            "gate": gate_record, "guard": {"rollbacks": counters.rollbacks},
            "feedback_models": feedback, "sft_adapter": str(adapter)}


def _accuracy(figures: dict) -> Optional[dict]:
    """The headline held-out accuracy: on pairs when there are any, else on
    labelled completions (KTO)."""
    for key in ("pair_accuracy", "label_accuracy"):
        if key in figures:
            return {"kind": key, "value": figures[key], "ci95": list(figures[f"{key}_ci"])}
    return None
