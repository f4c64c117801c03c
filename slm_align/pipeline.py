"""The pipeline: the only place that chains stages, sft -> reward -> gate ->
ppo|grpo|dpo|kto -> evaluate.

Each stage runs in :func:`slm_align.runs.run_stage`, which reuses it when it already completed
with the same inputs, so a run interrupted anywhere continues where it stopped. The CLI's
``train`` and the quickstart call these functions; a library caller can too
(``slm_align.run_rl`` is :func:`run_rl`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from slm_align.config import Recipe
from slm_align.config.from_sft import recipe_from_sft
from slm_align.config.rl import gate_resolves
from slm_align.envelope.gate import GateRefused, refusal
from slm_align.envelope.world import World
from slm_align.errors import UserError
from slm_align.evaluate.stage import evaluate
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.headroom.stage import check_headroom, record_report, reusable_report
from slm_align.modeling.accelerator import resolve_compute
from slm_align.preference.algorithms import trains_on_preferences
from slm_align.preference.stage import PreferenceStage, refuse_data_parallel
from slm_align.progress import quiet
from slm_align.reward_model.stage import run_reward
from slm_align.rl.llama_sampler import check_sampler
from slm_align.rl.stage import Prior, RLStage, check_divisible, rl_world
from slm_align.rollouts.episodes import check_episode_settings, check_task_file
from slm_align.runs import StageResult, read_manifest, run_stage
from slm_align.sft.stage import STAGE as SFT
from slm_align.sft.stage import run_sft
from slm_align.tracking import require_library

Say = Callable[[str], None]
STAGES = ("sft", "reward", "rl")
"""What ``train --stage`` runs: one Trainer stage, or RL (or DPO/KTO) with every stage it needs."""


def check_stage(stage: str) -> None:
    """``train --stage`` names one of :data:`STAGES`."""
    if stage not in STAGES:
        raise UserError(f"--stage {stage}: choose sft, reward or rl")


def sft_prior(recipe: Recipe, out: Path, sft_from: Optional[Path], resume: bool, say: Say) -> tuple[Recipe, Path]:
    """The SFT prior a later stage starts from: ``sft_from``'s finished SFT, or this run's (trained
    first when it is missing); returns the SFT recipe and adapter."""
    sft_run = Path(sft_from) if sft_from is not None else Path(out)
    if read_manifest(sft_run / SFT) is None:
        if sft_from is not None:
            raise UserError(f"--sft {sft_from} has no finished SFT stage (no sft/manifest.json)")
        say("running SFT first (no sft/ in the run)")
        run_sft(recipe, out, resume=resume)
    return recipe_from_sft(sft_run, recipe)


def reward_model_of(recipe: Recipe, out: Path, sft_from: Optional[Path], reward_model: Optional[Path],
                    rewards: Sequence[str], resume: bool, say: Say) -> Optional[Path]:
    """The reward model RL follows: the one given, none when reward functions are given alone, else
    the run's own (trained first when it is missing)."""
    if reward_model is not None or rewards:
        return reward_model
    if read_manifest(Path(out) / "reward") is None:
        if sft_from is not None:
            raise UserError("no reward: pass --reward-model or --reward when --sft "
                            "comes from another run")
        say("training the reward model first (no reward/ in the run)")
        run_reward(recipe, out, resume=resume)
    return Path(out) / "reward" / "model"


def gate(recipe: Recipe, out: Path, adapter: Optional[Path], reward_model: Optional[Path], rewards: Sequence[str],
         force: bool, say: Say = quiet) -> dict:
    """The headroom gate's report (the run's ``headroom.json`` when it was measured with
    these inputs, else a new measurement); a FAIL stops the pipeline
    (:class:`GateRefused`) unless ``force``."""
    report = reusable_report(recipe, out, adapter, reward_model, rewards)
    if report is None:
        report = check_headroom(recipe, run=out, adapter=adapter, reward_model=reward_model, rewards=rewards).to_dict()
        record_report(report, recipe, out, adapter, reward_model, rewards)
    else:
        say(f"headroom gate: {report['verdict']} (reused {Path(out) / 'headroom.json'}, "
            "measured with these inputs)")
    if not report["passed"] and not force:
        raise GateRefused(refusal("headroom gate", report))
    return report


def resolve_algorithm(recipe: Recipe, report: dict, say: Say) -> Recipe:
    """``--algo auto`` becomes the gate's recommendation (PPO or GRPO), said and
    recorded; others stay."""
    recommendation = report["info"].get("recommendation")
    if recommendation is not None:
        say(f"gate advice: {recommendation['why']}")
    if not gate_resolves(recipe.rl.algo):
        return recipe
    if recommendation is None:
        raise UserError("--algo auto follows the gate's advice, which needs the reward spread; the "
                        "gate could not measure it (fewer than two held-out prompts): "
                        "choose --algo ppo or grpo")
    rl = recipe.rl.model_copy(update={"algo": recommendation["algo"]})
    return recipe.model_copy(update={"rl": rl})


def check_finished_before_launch(out: Path, sft_from: Optional[Path], needs_reward_model: bool) -> None:
    """A data-parallel RL launch finds the stages it needs finished: rank 0 alone would train them
    while the other ranks wait, and the Trainer would ask those ranks to join in; refused in one
    line naming the stage to run first."""
    missing = []
    if sft_from is None and read_manifest(Path(out) / SFT) is None:
        missing.append("sft")
    if needs_reward_model and read_manifest(Path(out) / "reward") is None:
        missing.append("reward")
    if missing:
        raise UserError(f"a data-parallel RL launch needs the {' and '.join(missing)} stage of {out} finished first: "
                        f"run `slm-align train --stage {missing[0]} --out {out}` (launched the "
                        "same way or not), then launch RL again")


@dataclass(frozen=True)
class RLRequest:
    """What ``train`` asks of RL besides the recipe: the stages to take from
    elsewhere, the reward, the gate."""

    sft_from: Optional[Path] = None
    reward_model: Optional[Path] = None
    rewards: tuple[str, ...] = ()
    force: bool = False
    resume: bool = False


def rl_prior(recipe: Recipe, out: Path, request: RLRequest, world: World, say: Say) -> Prior:
    """The stages RL needs (run or found) and the gate, on rank 0. With ``rl.from_sft`` off RL
    starts from the model as given: no SFT, no adapter, and a reward must be given (the reward stage
    trains on the SFT prior)."""
    reward_model = request.reward_model
    if not recipe.rl.from_sft:
        if reward_model is None and not request.rewards:
            raise UserError("--no-sft starts RL from the model as given, without the SFT prior the "
                            "reward stage trains on: pass --reward (e.g. exact_answer, "
                            "tool_task) or --reward-model")
        sft_recipe, adapter = recipe, None
    else:
        if world.size > 1:
            check_finished_before_launch(out, request.sft_from, reward_model is None and not request.rewards)
        sft_recipe, adapter = sft_prior(recipe, out, request.sft_from, request.resume, say)
        reward_model = reward_model_of(recipe, out, request.sft_from, reward_model, request.rewards,
                                       request.resume, say)
    note_kept_seed(recipe, sft_recipe, say)
    recipe = sft_recipe.model_copy(update={"rl": recipe.rl})
    report = gate(recipe, out, adapter, reward_model, request.rewards, request.force, say)
    recipe = resolve_algorithm(recipe, report, say)
    return Prior(recipe, adapter, reward_model, report, forced=bool(request.force and not report["passed"]))


def note_kept_seed(recipe: Recipe, sft_recipe: Recipe, say: Say) -> None:
    """Say so when the recipe's seed is not the finished SFT stage's, which RL keeps (its split, held-out
    prompts and probes): the other seed would otherwise be dropped without a word."""
    if sft_recipe.seed != recipe.seed:
        say(f"RL keeps the SFT stage's seed {sft_recipe.seed} (its split and held-out prompts), not seed "
            f"{recipe.seed}: set rl.seed to seed RL's own draws")


def run_rl(recipe: Recipe, out: Path, resume: bool = False, force: bool = False,
           sft_from: Optional[Path] = None, reward_model: Optional[Path] = None,
           rewards: Sequence[str] = (), say: Say = quiet) -> StageResult:
    """SFT and the reward model (run or found) and the gate, on rank 0; then PPO or GRPO on every
    rank of the world (one process unless launched)."""
    if trains_on_preferences(recipe.rl.algo):
        raise UserError(f"--algo {recipe.rl.algo} is preference optimisation, not RL: run it with "
                        "slm_align.pipeline.run_preference (the CLI's train does)")
    out = Path(out)
    world, compute = rl_world(recipe)
    check_divisible(recipe.rl, world)
    check_episode_settings(recipe.rl, recipe.data.tasks is not None, rewards)
    # environments named by rows: allowed ones only, before any import
    check_task_file(recipe.rl, recipe.data.tasks)
    check_sampler(recipe.rl, recipe.model)
    request = RLRequest(sft_from, reward_model, tuple(rewards), force, resume)
    prior = world.on_main(functools.partial(rl_prior, recipe, out, request, world, say))
    return run_stage(RLStage(prior, rewards, world, compute, say), out, resume)


def run_preference(recipe: Recipe, out: Path, resume: bool = False, force: bool = False,
                   sft_from: Optional[Path] = None, say: Say = quiet) -> StageResult:
    """DPO or KTO (``recipe.rl.algo``) on ``recipe.reward.preferences`` from the run's SFT prior
    (trained first when it is missing)."""
    refuse_data_parallel(recipe.rl.algo)
    require_library(recipe.tracking.report_to)
    resolve_compute(recipe.compute, trainer=False)  # settings DPO and KTO refuse, before SFT runs
    sft_recipe, adapter = sft_prior(recipe, out, sft_from, resume, say)
    recipe = sft_recipe.model_copy(update={"rl": recipe.rl, "preference": recipe.preference,
                                           "reward": recipe.reward})
    return run_stage(PreferenceStage(recipe, out, adapter, force, say), out, resume)


def data_from_run(recipe: Recipe, stage: str, out: Path, sft_from: Optional[Path]) -> bool:
    """Whether the stage takes its corpus from a finished SFT stage (the run's, or
    --sft's) rather than --data."""
    if stage == "reward" or sft_from is not None:
        return True
    return stage == "rl" and recipe.rl.from_sft and read_manifest(Path(out) / SFT) is not None


@dataclass
class Trained:
    """What ``train`` did: the stage's result and, after RL with ``rl.report_prompts``,
    the evaluation report."""

    result: StageResult
    evaluation: Optional[dict] = None


def train(recipe: Recipe, out: Path, stage: str = "rl", request: RLRequest = RLRequest(),
          say: Say = quiet) -> Trained:
    """What ``slm-align train`` runs: one Trainer stage (``sft``, ``reward``); or, for ``rl``,
    DPO/KTO (``--algo dpo|kto``) or RL with every stage it needs, then the closing evaluation
    (unless ``rl.report_prompts`` is 0, or RL trained on agent episodes: an agent is judged by
    ``evaluate-agent`` in the runtime, after export)."""
    check_stage(stage)
    if stage == "sft":
        return Trained(run_sft(recipe, out, resume=request.resume))
    if stage == "reward":
        return Trained(run_reward(recipe, out, resume=request.resume))
    if trains_on_preferences(recipe.rl.algo):
        return Trained(run_preference(recipe, out, resume=request.resume, force=request.force,
                                      sft_from=request.sft_from, say=say))
    result = run_rl(recipe, out, resume=request.resume, force=request.force,
                    sft_from=request.sft_from, reward_model=request.reward_model,
                    rewards=request.rewards, say=say)
    # other ranks of a data-parallel run: rank 0 reports
    if not result.primary or recipe.rl.report_prompts == 0:
        return Trained(result)
    # an agent is judged in the runtime: export, then evaluate-agent
    if result.metrics.get("episodes"):
        return Trained(result)
    report = evaluate(recipe, out, sft_run=request.sft_from, reward_model=request.reward_model,
                      rewards=request.rewards, prompts=recipe.rl.report_prompts)
    return Trained(result, report)


def export_once(source: Path, target: str, quant: str, out: Optional[Path] = None) -> dict:
    """Export ``source`` (a run: its latest policy, merged) to ``target`` at ``quant`` (parity-checked) into
    ``out`` (default ``source/export``), or the artifact an earlier call made there."""
    out = Path(out) if out is not None else Path(source) / "export"
    result = run_export(ExportRequest(str(source), target, quant, out=out, overwrite=True), reuse=True)
    if result.skipped:
        return {"dir": str(result.stage_dir), "skipped": True, "metrics": result.metrics}
    return result.summary()
