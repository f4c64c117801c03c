"""The RL stage: the stages it needs, the headroom gate, then PPO (rl/ppo.py) or GRPO (rl/grpo.py); artifacts
in ``OUT/rl/``.

Artifacts: ``adapter/`` (the RL LoRA on top of the merged SFT weights), ``value_head.safetensors`` (PPO),
``metrics.jsonl`` (one line per iteration), ``plots/training_curves.png`` and ``manifest.json`` (the gate's
verdict and any ``--force``, guard totals, and held-out reward of the SFT policy and of the RL policy).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import torch

from slm_align.accelerator import resolve_compute, training_inputs
from slm_align.atomic import atomic_path
from slm_align.config import Recipe
from slm_align.data.prompt_source import prompt_source
from slm_align.data.readers import fingerprint
from slm_align.envelope.policy import build_policy, policy_rewards
from slm_align.envelope.value_head import ValueHead
from slm_align.envelope.world import World, rank_device, replica_digest, world_from_env
from slm_align.errors import UserError
from slm_align.headroom import GateRefused, check_headroom
from slm_align.modeling import load_tokenizer, resolve_source, save_adapter
from slm_align.plots import plot_curves
from slm_align.progress import new_progress, stage_lines
from slm_align.reward.learned import learned_reward
from slm_align.reward.stage import run_reward
from slm_align.rl.grpo import GRPO
from slm_align.rl.ppo import PPO
from slm_align.rl.recovery import EVENTS, WatchedRun, probe_rewards, restore
from slm_align.rl.schedule import iteration_size
from slm_align.rl.watchdog import Watchdog, read_events
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

STAGE = "rl"
CHECKPOINT = "checkpoint.pt"


def heldout_reward(policy, tokenizer, reward_fn, prompts: list[str], recipe: Recipe, adapter: bool) -> float:
    """Mean reward of one sampled completion per held-out prompt, with the RL adapter on (RL) or off (SFT)."""
    policy_name = "RL" if adapter else "SFT"
    with stage_lines("held-out reward", f"the {policy_name} policy on {len(prompts)} prompts") as stage:
        mean = statistics.fmean(policy_rewards(policy, tokenizer, reward_fn, prompts, recipe.rl, recipe.seed, adapter))
        stage.figures = f"mean reward {mean:.3f}"
    return mean


def _prerequisites(recipe: Recipe, out: Path, sft_from: Optional[Path], reward_model: Optional[Path],
                   rewards: Sequence[str], resume: bool, say, world: World) -> tuple[Recipe, Optional[Path],
                                                                                      Optional[Path]]:
    """Run (or find) SFT and the reward model; returns the SFT recipe, its adapter and the reward model.

    With ``rl.from_sft`` off RL starts from the model as given: no SFT, no adapter, and a reward must be given
    (the reward stage trains on the SFT prior)."""
    if not recipe.rl.from_sft:
        if reward_model is None and not rewards:
            raise UserError("--no-sft starts RL from the model as given, without the SFT prior the reward stage "
                            "trains on: pass --reward (e.g. exact_answer, tool_task) or --reward-model")
        return recipe, None, reward_model
    if world.size > 1:
        _check_finished_before_launch(out, sft_from, reward_model is None and not rewards)
    sft_recipe, adapter = sft_prior(recipe, out, sft_from, resume, say)
    if reward_model is None and not rewards:
        if read_manifest(out / "reward") is None:
            if sft_from is not None:
                raise UserError("no reward: pass --reward-model or --reward when --sft comes from another run")
            say("training the reward model first (no reward/ in the run)")
            run_reward(recipe, out, resume=resume)
        reward_model = out / "reward" / "model"
    return sft_recipe, adapter, reward_model


def _check_finished_before_launch(out: Path, sft_from: Optional[Path], needs_reward_model: bool) -> None:
    """A data-parallel RL launch finds the stages it needs finished: rank 0 alone would train them while the other
    ranks wait, and the Trainer would ask those ranks to join in; refused in one line naming the stage to run first."""
    missing = []
    if sft_from is None and read_manifest(out / "sft") is None:
        missing.append("sft")
    if needs_reward_model and read_manifest(out / "reward") is None:
        missing.append("reward")
    if missing:
        raise UserError(f"a data-parallel RL launch needs the {' and '.join(missing)} stage of {out} finished first: "
                        f"run `slm-align train --stage {missing[0]} --out {out}` (launched the same way or not), then "
                        "launch RL again")


def run_rl(recipe: Recipe, out: Path, resume: bool = False, force: bool = False, sft_from: Optional[Path] = None,
           reward_model: Optional[Path] = None, rewards: Sequence[str] = (), say=lambda _: None) -> StageResult:
    """Prerequisites and the gate (on rank 0), then RL on every rank of the world (one process unless launched)."""
    if recipe.rl.algo in ("dpo", "kto"):
        raise UserError(f"--algo {recipe.rl.algo} is preference optimisation, not RL: run it with "
                        "slm_align.preference.stage.run_preference (the CLI's train does)")
    started = time.time()
    require_library(recipe.tracking.report_to)
    out = Path(out)
    compute = resolve_compute(recipe.compute, trainer=False)
    compute = replace(compute, device=rank_device(compute.device))
    world = world_from_env(compute.device)
    _check_divisible(recipe.rl, world)
    prepare = functools.partial(_prepare, recipe, out, resume, force, sft_from, reward_model, rewards, say, world)
    recipe, adapter, reward_model, inputs, gate, done = world.on_main(prepare)
    _check_divisible(recipe.rl, world)  # again: --algo auto has become ppo or grpo
    if done is not None:
        return StageResult(out / STAGE, skipped=True, metrics=done["metrics"])
    return _train(recipe, adapter, reward_model, rewards, inputs, gate, out / STAGE, resume, started, world,
                  compute, say)


def _check_divisible(settings, world: World) -> None:
    """Ranks share an iteration's prompt draws (GRPO: whole groups): refuse a world that cannot split them evenly."""
    sequences = iteration_size(settings).prompts
    if sequences % world.size:
        unit = "prompts" if settings.algo == "grpo" else "samples"
        raise UserError(f"{world.size} processes cannot share {sequences} {unit} per iteration evenly; "
                        "change --prompts-per-step or the number of processes")


def _prepare(recipe, out, resume, force, sft_from, reward_model, rewards, say, world):
    """Stages RL needs, the gate, and whether RL already completed with these inputs (rank 0)."""
    sft_recipe, adapter, reward_model = _prerequisites(recipe, out, sft_from, reward_model, rewards, resume, say,
                                                       world)
    recipe = sft_recipe.model_copy(update={"rl": recipe.rl})
    gate = check_headroom(recipe, run=out, adapter=adapter, reward_model=reward_model, rewards=rewards).to_dict()
    if not gate["passed"] and not force:
        raise GateRefused(f"headroom gate FAIL ({'; '.join(gate['reasons'])}): {' '.join(gate['remedies'])} "
                          "Pass --force to train anyway (recorded in the manifest).")
    recipe = _resolve_algorithm(recipe, gate, say)
    sft = None
    if adapter is not None:
        sft = {"adapter": str(adapter), "inputs_hash": read_manifest(adapter.parent)["inputs_hash"]}
    tasks = None
    if recipe.data.tasks is not None:
        tasks = fingerprint(Path(recipe.data.tasks))
    inputs = {"sft": sft, "tasks": tasks, "reward_model": str(reward_model) if reward_model else None,
              "rewards": list(rewards), "seed": recipe.seed,
              "rl": recipe.rl.model_dump(exclude={"report_prompts"}),  # reporting, not training
              "forced": bool(force and not gate["passed"]), **training_inputs(recipe.compute)}
    return recipe, adapter, reward_model, inputs, gate, completed(out / STAGE, inputs)


def _resolve_algorithm(recipe: Recipe, gate: dict, say) -> Recipe:
    """``--algo auto`` becomes the gate's recommendation (PPO or GRPO), said and recorded; others stay."""
    recommendation = gate["info"].get("recommendation")
    if recommendation is not None:
        say(f"gate advice: {recommendation['why']}")
    if recipe.rl.algo != "auto":
        return recipe
    if recommendation is None:
        raise UserError("--algo auto follows the gate's advice, which needs the reward spread; the gate could not "
                        "measure it (fewer than two held-out prompts): choose --algo ppo or grpo")
    rl = recipe.rl.model_copy(update={"algo": recommendation["algo"]})
    return recipe.model_copy(update={"rl": rl})


def _train(recipe, adapter, reward_model, rewards, inputs, gate, stage_dir, resume, started, world, compute,
           say=lambda _: None) -> StageResult:
    """Build the learner, iterate (resuming from the checkpoint) under the watchdog, measure held-out reward,
    publish on rank 0 (the best probe's adapter when the watchdog is on, the last one beside it)."""
    settings = recipe.rl
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    prompts = prompt_source(recipe, tokenizer)
    train_prompts = prompts.train
    eval_prompts = prompts.heldout[: settings.eval_prompts]
    if not train_prompts or not eval_prompts:
        raise UserError("no prompts for RL: the corpus has no documents long enough to split into prompt and rest")
    reward_fn = prompts.reward(rewards, learned=learned_reward(reward_model, compute.device))
    policy = build_policy(source, adapter, settings, recipe.seed, recipe.model.trust_remote_code,
                          recipe.model.allow_pickle, compute.device)
    value_head = None
    if settings.algo == "ppo":
        value_head = ValueHead(policy.config.hidden_size).to(compute.device)
    algorithm = PPO if settings.algo == "ppo" else GRPO
    loop = algorithm(policy, tokenizer, reward_fn, train_prompts, settings, recipe.seed, value_head, world,
                     compute.precision, compute.gradient_checkpointing)
    partial = partial_dir(stage_dir)
    if world.main:
        prepare_partial(partial, inputs, resume)
    world.barrier()
    watch = _watch(recipe, loop, prompts.heldout, partial, world, say)
    _load_checkpoint(loop, watch, partial)
    tracker = Tracker()
    if world.main:
        resume_step = loop.step if (partial / CHECKPOINT).is_file() else None
        tracker = open_tracker(recipe, stage_dir.parent, STAGE, resume_step)
    before = heldout_reward(policy, tokenizer, reward_fn, eval_prompts, recipe, adapter=False)
    try:
        _iterate(loop, partial, world, watch, tracker)
    finally:
        tracker.close()
    last = _keep_last(loop, watch, partial, world, lambda: heldout_reward(policy, tokenizer, reward_fn, eval_prompts,
                                                                          recipe, adapter=True))
    after = heldout_reward(policy, tokenizer, reward_fn, eval_prompts, recipe, adapter=True)
    replicas = world.gather(replica_digest(loop.params))
    if not world.main:
        world.barrier()
        return StageResult(stage_dir, skipped=False, metrics={}, primary=False)
    save_adapter(policy, partial / "adapter")
    if value_head is not None:
        from safetensors.torch import save_file

        save_file({name: t.cpu() for name, t in value_head.state_dict().items()}, partial / "value_head.safetensors")
    events = read_events(partial / EVENTS)
    plot_curves(partial / "metrics.jsonl", partial / "plots" / "training_curves.png", events=events)
    heldout = {"heldout_reward_sft": before, "heldout_reward_rl": after, "heldout_reward_delta": after - before,
               "eval_prompts": len(eval_prompts)}
    result = dict(heldout, **_run_figures(loop, gate, inputs, adapter, world, replicas), compute=compute.record())
    result["watchdog"] = _watchdog_figures(watch, last, events, loop.step)
    publish(partial, stage_dir, make_manifest(STAGE, inputs, result, started),
            keep=("adapter", "adapter-last", EVENTS, "value_head.safetensors", "metrics.jsonl", "plots",
                  "inputs.json"))
    world.barrier()
    return StageResult(stage_dir, skipped=False, metrics=result)


def _load_checkpoint(loop, watch: Optional[WatchedRun], partial: Path) -> None:
    """Continue from the partial dir's checkpoint, when there is one: the learner's state and the watchdog's."""
    if not (partial / CHECKPOINT).is_file():
        return
    state = torch.load(partial / CHECKPOINT, weights_only=True)
    loop.load_state_dict(state)
    if watch is not None:
        watch.watchdog.load_state_dict(state["watchdog"])


def _watch(recipe: Recipe, loop, heldout: list[str], partial: Path, world: World, say) -> Optional[WatchedRun]:
    """The run's watchdog (None when it is off). Its probe is the last ``probe_prompts`` held-out prompts: apart
    from the first ``eval_prompts`` that measure the published adapter whenever the held-out set has room."""
    settings = recipe.rl.watchdog
    if not settings.enabled:
        return None
    prompts = heldout[-settings.probe_prompts:]

    def probe() -> list[float]:
        """Per-prompt rewards of the current adapter on the probe prompts (the recipe's seed)."""
        return probe_rewards(loop.policy, loop.tokenizer, loop.reward_fn, prompts, recipe.rl, recipe.seed)

    return WatchedRun(Watchdog(settings), probe, partial, world, say, recipe.rl.grpo.beta)


def _keep_last(loop, watch: Optional[WatchedRun], partial: Path, world: World, measure) -> Optional[dict]:
    """With the watchdog on: save the last adapter as ``adapter-last`` (rank 0), measure it, then put the best
    probe's weights back for publishing. Returns the last adapter's iteration and held-out reward."""
    if watch is None:
        return None
    if world.main:
        save_adapter(loop.policy, partial / "adapter-last")
    if watch.watchdog.best_step == loop.step:
        return {"step": loop.step, "heldout_reward": None, "is_published": True}  # the same weights: not measured
    started = time.perf_counter()
    last = {"step": loop.step, "heldout_reward": measure(), "is_published": False}
    restore(loop, watch.watchdog.best_state)
    watch.seconds += time.perf_counter() - started
    return last


def _watchdog_figures(watch: Optional[WatchedRun], last: Optional[dict], events: list[dict], steps: int) -> dict:
    """The manifest's watchdog record: off (the last iteration, ``steps``, published), or the published (best)
    iteration, the last one, events, stop reason."""
    if watch is None:
        return {"enabled": False, "published_step": steps}
    summary = watch.watchdog.summary()
    return dict(summary, published_step=summary["best_step"], last=last, events=len(events),
                detectors=sorted({event["detector"] for event in events}), seconds=round(watch.seconds, 3))


def _iterate(loop, partial: Path, world: World, watch: Optional[WatchedRun], tracker: Tracker) -> None:
    """Run the remaining iterations under the watchdog (when on); rank 0 appends each one's metrics (and reports them
    to the tracker) and checkpoints every ``save_steps``, at the end, and when the watchdog stops the run."""
    settings = loop.settings
    metrics_path = partial / "metrics.jsonl"
    if world.main:
        keep_first_lines(metrics_path, loop.step)  # steps after the checkpoint are trained again
    if watch is not None:
        watch.begin(loop, tracker)
    with new_progress() as progress:
        task = progress.add_task(f"RL ({settings.algo})", total=settings.steps, completed=loop.step, status="")
        for step in range(loop.step, settings.steps):
            if watch is not None and watch.stopped:
                break
            metrics = loop.run_step(step)
            if watch is not None:
                watch.after_step(loop, metrics)
            progress.update(task, completed=loop.step, status=f"reward {metrics['reward/mean']:.3f}")
            if not world.main:
                continue
            with open(metrics_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(metrics) + "\n")
            tracker.log(loop.step, metrics)
            stopping = watch is not None and watch.stopped is not None
            if loop.step % settings.save_steps == 0 or loop.step == settings.steps or stopping:
                _checkpoint(loop, watch, partial)


def _checkpoint(loop, watch: Optional[WatchedRun], partial: Path) -> None:
    """Write the learner's state (and the watchdog's: windows, best weights, recoveries) atomically."""
    state = loop.state_dict()
    if watch is not None:
        state["watchdog"] = watch.watchdog.state_dict()
    with atomic_path(partial / CHECKPOINT) as tmp:
        torch.save(state, tmp)


def _run_figures(loop, gate: dict, inputs: dict, adapter, world: World, replicas: list[str]) -> dict:
    """What the manifest records about the run besides held-out reward: steps, guards, gate, envelope, replicas."""
    counters = loop.counters
    return {"steps": loop.step, "algo": loop.settings.algo, "learning_rate": loop.learning_rate,
            "guard": {"skipped": counters.skipped, "rollbacks": counters.rollbacks,
                      "score_clipped": counters.score_clipped, "advantage_clipped": counters.advantage_clipped},
            "gate": {"verdict": gate["verdict"], "forced": inputs["forced"], "reasons": gate["reasons"],
                     "advice": gate["info"].get("recommendation")},
            "envelope": loop.settings.envelope.model_dump(), "sft_adapter": str(adapter) if adapter else None,
            "reward_model": inputs["reward_model"], "world_size": world.size, "replica_digests": replicas,
            "replicas_identical": len(set(replicas)) == 1}
