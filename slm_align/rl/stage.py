"""The RL stage: PPO (rl/ppo.py) or GRPO (rl/grpo.py) from the SFT prior, under the
collapse watchdog; artifacts in ``OUT/rl/``. The stages it needs and the headroom gate run
before it (slm_align/pipeline.py).

Artifacts: ``adapter/`` (the RL LoRA on top of the merged SFT weights), ``value_head.safetensors``
(PPO), ``metrics.jsonl`` (one line per iteration), ``plots/training_curves.png`` and
``manifest.json`` (the gate's verdict and any ``--force``, guard totals, and held-out reward of the
SFT policy and of the RL policy).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from slm_align.config import Recipe, RLSettings
from slm_align.config.rl import algorithm_candidates
from slm_align.data.prompt_source import prompt_source
from slm_align.data.readers import fingerprint
from slm_align.envelope.loop import StepPlan, StepRecord, load_checkpoint, train_steps
from slm_align.envelope.policy import build_policy
from slm_align.envelope.recovery import (
    EVENTS,
    WatchedRun,
    fresh_seed,
    probe_rewards,
    read_events,
    restore,
    scale_shaping,
)
from slm_align.envelope.run import Placement
from slm_align.envelope.value_head import ValueHead
from slm_align.envelope.watchdog import Watchdog
from slm_align.envelope.world import World, rank_device, replica_digest, world_from_env
from slm_align.errors import UserError
from slm_align.modeling.accelerator import resolve_compute, training_inputs
from slm_align.modeling.models import load_tokenizer, resolve_source, save_adapter
from slm_align.plots import plot_curves
from slm_align.progress import stage_lines
from slm_align.rl.algorithms import rl_algorithm
from slm_align.rl.learner import Learner, RolloutSource
from slm_align.rl.llama_episodes import EPISODE_CONTEXT
from slm_align.rl.llama_sampler import LlamaSampler
from slm_align.rollouts.episodes import agent_tasks, check_episode_rewards
from slm_align.rollouts.policy_backend import policy_template
from slm_align.runs import LAST_ADAPTER, artifact_digest, stage_identity
from slm_align.scoring.learned_reward import learned_reward
from slm_align.tracking import Tracker, open_tracker, require_library

STAGE = "rl"


@dataclass(frozen=True)
class Prior:
    """What RL starts from, settled before it (slm_align/pipeline.py): the recipe (the SFT stage's
    model, seed and data; ``rl.algo`` resolved), the SFT adapter (None when RL starts from the model
    as given), the reward model (None: reward functions only), and the gate's report with whether
    ``--force`` overrode a FAIL."""

    recipe: Recipe
    adapter: Optional[Path]
    reward_model: Optional[Path]
    gate: dict
    forced: bool


def rl_world(recipe: Recipe) -> tuple[World, object]:
    """The processes RL runs on (one unless launched) and its compute settings
    on this rank's device."""
    require_library(recipe.tracking.report_to)
    compute = resolve_compute(recipe.compute, trainer=False)
    compute = replace(compute, device=rank_device(compute.device))
    return world_from_env(compute.device), compute


def check_divisible(settings: RLSettings, world: World) -> None:
    """Ranks share an iteration's prompt draws (GRPO: whole groups): refuse a world that cannot
    split them evenly. ``auto``, which the gate resolves later, is refused only when no algorithm
    it may become could split them."""
    candidates = [rl_algorithm(name) for name in algorithm_candidates(settings.algo)]
    refusals = [indivisible(algorithm, settings, world) for algorithm in candidates]
    if all(refusals):
        raise UserError(refusals[0])


def indivisible(algorithm: type[Learner], settings: RLSettings, world: World) -> Optional[str]:
    """Why ``world`` cannot share ``algorithm``'s draws of an iteration evenly; None when it can."""
    draws = algorithm.iteration_size(settings).prompts
    if draws % world.size == 0:
        return None
    return (f"{world.size} processes cannot share {draws} {algorithm.draw_unit} per iteration "
            "evenly; change --prompts-per-step or the number of processes")


def heldout_reward(loop, prompts: list[str], seed: int, adapter: bool) -> float:
    """Mean reward of one sampled completion (or agent episode) per held-out prompt, with the RL
    adapter on (RL) or off (SFT)."""
    policy_name = "RL" if adapter else "SFT"
    unit = "episodes" if loop.episodes is not None else "prompts"
    with stage_lines("held-out reward", f"the {policy_name} policy on {len(prompts)} {unit}") as stage:
        mean = statistics.fmean(loop.sample_rewards(prompts, seed, adapter))
        stage.figures = f"mean reward {mean:.3f}"
    return mean


def training_seed(recipe) -> int:
    """What seeds RL's training draws: ``rl.seed``, else the recipe's seed."""
    return recipe.rl.seed if recipe.rl.seed is not None else recipe.seed


class RLStage:
    """PPO or GRPO as a :class:`~slm_align.runs.Stage`: the learner on every rank, the watchdog,
    held-out reward of the SFT and RL policies, the best probe's adapter published (rank 0)."""

    name = STAGE
    keep = ("adapter", LAST_ADAPTER, EVENTS, "value_head.safetensors", "metrics.jsonl", "plots", "inputs.json")

    def __init__(self, prior: Prior, rewards: Sequence[str], world: World, compute,
                 say: Callable[[str], None]):
        check_divisible(prior.recipe.rl, world)
        self.algorithm = rl_algorithm(prior.recipe.rl.algo)
        self.prior = prior
        self.recipe = prior.recipe
        self.rewards = list(rewards)
        self.world = world
        self.compute = compute
        self.say = say

    def inputs(self) -> dict:
        """What the adapter depends on. Earlier stages are named by their
        content (:func:`stage_identity`,
        :func:`artifact_digest`), never by a path, so a run moved or copied elsewhere is reused as it is."""
        recipe = self.recipe
        prior = self.prior
        sft = None
        if prior.adapter is not None:
            sft = stage_identity(prior.adapter.parent)
        tasks = None
        if recipe.data.tasks is not None:
            tasks = fingerprint(Path(recipe.data.tasks))
        reward_model = None
        if prior.reward_model is not None:
            reward_model = artifact_digest(prior.reward_model)
        return {"sft": sft, "tasks": tasks, "reward_model": reward_model, "rewards": self.rewards,
                "seed": recipe.seed, "rl": recipe.rl.model_dump(exclude={"report_prompts"}),  # reporting only
                "forced": prior.forced, **training_inputs(recipe.compute)}

    def setup(self) -> None:
        """The prompts, the reward, the policy (merged SFT prior + fresh LoRA) and the learner."""
        recipe = self.recipe
        settings = recipe.rl
        device = self.compute.device
        source = resolve_source(recipe.model.source)
        self.tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
        self.prompts = prompt_source(recipe, self.tokenizer)
        self.eval_prompts = self.prompts.heldout[: settings.eval_prompts]
        if not self.prompts.train or not self.eval_prompts:
            raise UserError("no prompts for RL: the corpus has no documents long enough to split "
                            "into prompt and rest")
        learned = learned_reward(self.prior.reward_model, device)
        self.reward_fn = self.prompts.reward(self.rewards, learned=learned)
        episodes = agent_tasks(settings, self.prompts.tasks)
        check_episode_rewards(self.reward_fn, episodes)
        if episodes is not None:
            episodes.check_template(self.tokenizer)
        seed = training_seed(recipe)
        model = recipe.model
        self.policy = build_policy(source, self.prior.adapter, settings, seed,
                                   model.trust_remote_code, model.allow_pickle, device)
        algorithm = self.algorithm
        self.value_head = None
        if algorithm.needs_value_head:
            self.value_head = ValueHead(self.policy.config.hidden_size).to(device)
        placement = Placement(self.world, self.compute.precision,
                              self.compute.gradient_checkpointing)
        rollouts = RolloutSource(self.prompts.train, episodes, self._sampler(source, episodes))
        self.loop = algorithm(self.policy, self.tokenizer, self.reward_fn, rollouts,
                              settings, seed, self.value_head, placement)

    def _sampler(self, source, episodes) -> Optional[LlamaSampler]:
        """llama.cpp as the rollouts' sampler when the recipe asks (its files in a temporary folder: the base
        GGUF once, the adapter each iteration); None: PyTorch samples."""
        settings = self.recipe.rl
        if settings.sampler != "llama_cpp":
            return None
        self._sampler_files = tempfile.TemporaryDirectory(prefix="slm-align-sampler-")
        n_ctx = self.recipe.data.max_length + settings.max_new_tokens + 8
        with stage_lines("llama.cpp sampler", f"the policy's base ({settings.sampler_base})"):
            sampler = LlamaSampler(self.policy, self.tokenizer, source, Path(self._sampler_files.name),
                                   settings.sampler_base, torch.get_num_threads(), n_ctx, self.prior.adapter)
        if episodes is not None:  # the runtime's own backend runs the episodes on the same base
            positions = getattr(self.policy.config, "max_position_embeddings", None) or EPISODE_CONTEXT
            sampler.for_episodes(policy_template(self.tokenizer, episodes.chat_template), positions)
        return sampler

    def train(self, partial: Path, checkpoint: Optional[str]) -> None:
        """Iterate from the work dir's checkpoint (if any) under the watchdog; held-out
        reward before and after."""
        loop = self.loop
        self.watch = self._watch(partial)
        state = load_checkpoint(partial)
        if state is not None:
            loop.load_state_dict(state)
            if self.watch is not None:
                self.watch.watchdog.load_state_dict(state["watchdog"])
        tracker = Tracker()
        if self.world.main:
            resume_step = loop.step if state is not None else None
            tracker = open_tracker(self.recipe, partial.parent, STAGE, resume_step)
        self.before = self._heldout(adapter=False)
        try:
            self._iterate(partial, tracker)
        finally:
            tracker.close()
            if loop.sampler is not None:  # llama.cpp's context and adapter, and the sampler's files
                loop.sampler.close()
                self._sampler_files.cleanup()
        self.last = self._keep_last(partial)
        self.after = self._heldout(adapter=True)

    def save(self, partial: Path) -> Optional[dict]:
        """The published adapter (the best probe's with the watchdog on), the value
        head, plots; the metrics."""
        loop = self.loop
        replicas = self.world.gather(replica_digest(loop.params))
        if not self.world.main:
            return None
        save_adapter(self.policy, partial / "adapter")
        if self.value_head is not None:
            from safetensors.torch import save_file

            state = {name: t.cpu() for name, t in self.value_head.state_dict().items()}
            save_file(state, partial / "value_head.safetensors")
        events = read_events(partial / EVENTS)
        plot_curves(partial / "metrics.jsonl", partial / "plots" / "training_curves.png", events=events)
        heldout = {"heldout_reward_sft": self.before, "heldout_reward_rl": self.after,
                   "heldout_reward_delta": self.after - self.before, "eval_prompts": len(self.eval_prompts)}
        result = dict(heldout, **self._run_figures(replicas), compute=self.compute.record())
        result["watchdog"] = _watchdog_figures(self.watch, self.last, events, loop.step)
        return result

    # ---- training --------------------------------------------------------------------------------
    def _heldout(self, adapter: bool) -> float:
        return heldout_reward(self.loop, self.eval_prompts, self.recipe.seed, adapter)

    def _iterate(self, partial: Path, tracker: Tracker) -> None:
        """The remaining iterations under the watchdog (when on): its probes,
        rollbacks and early stop."""
        loop = self.loop
        watch = self.watch
        if watch is not None:
            watch.begin(loop, tracker)

        def iteration() -> dict:
            """One PPO or GRPO iteration, then the watchdog's look at it."""
            metrics = loop.run_step(loop.step)
            if watch is not None:
                watch.after_step(loop, metrics)
            return metrics

        def state() -> dict:
            """The learner's state, and the watchdog's (windows, best weights, recoveries)."""
            saved = loop.state_dict()
            if watch is not None:
                saved["watchdog"] = watch.watchdog.state_dict()
            return saved

        def stopped() -> bool:
            return watch is not None and watch.stopped is not None

        settings = self.recipe.rl
        plan = StepPlan(iteration, settings.steps, title=f"RL ({settings.algo})",
                        status=_reward_status, stopped=stopped)
        record = StepRecord(partial, state, settings.save_steps, self.world, tracker)
        train_steps(loop, plan, record)

    def _watch(self, partial: Path) -> Optional[WatchedRun]:
        """The run's watchdog (None when it is off). Its probe is the last ``probe_prompts``
        held-out prompts: apart from the first ``eval_prompts`` that measure the published adapter
        whenever the held-out set has room."""
        recipe = self.recipe
        settings = recipe.rl.watchdog
        if not settings.enabled:
            return None
        prompts = self.prompts.heldout[-settings.probe_prompts:]
        loop = self.loop

        def probe(offset: int = 0) -> list[float]:
            """Per-prompt rewards of the current adapter on the probe prompts (the recipe's seed,
            or a fresh one for ``offset`` > 0)."""
            return probe_rewards(loop, prompts, fresh_seed(recipe.seed, offset))

        return WatchedRun(Watchdog(settings), probe, partial, self.world, self.say, recipe.rl.grpo.beta)

    def _keep_last(self, partial: Path) -> Optional[dict]:
        """With the watchdog on: save the last adapter as ``adapter-last`` (rank 0), measure it,
        then put the best probe's weights back for publishing (and the reward's base weights, which
        the held-out reward is measured with). Returns the last adapter's iteration and held-out
        reward."""
        watch = self.watch
        loop = self.loop
        if watch is None:
            return None
        scale_shaping(loop, 1.0)
        if self.world.main:
            save_adapter(loop.policy, partial / LAST_ADAPTER)
        if watch.watchdog.best_step == loop.step:
            return {"step": loop.step, "heldout_reward": None, "is_published": True}  # the same weights
        started = time.perf_counter()
        last = {"step": loop.step, "heldout_reward": self._heldout(adapter=True), "is_published": False}
        restore(loop, watch.watchdog.best_state)
        watch.seconds += time.perf_counter() - started
        return last

    def _run_figures(self, replicas: list[str]) -> dict:
        """What the manifest records besides held-out reward: steps, guards,
        gate, envelope, replicas."""
        loop = self.loop
        gate = self.prior.gate
        counters = loop.counters
        adapter = self.prior.adapter
        reward_model = self.prior.reward_model
        return {"steps": loop.step, "algo": loop.settings.algo, "learning_rate": loop.learning_rate,
                "episodes": loop.episodes is not None,
                "guard": {"skipped": counters.skipped, "rollbacks": counters.rollbacks,
                          "score_clipped": counters.score_clipped, "advantage_clipped": counters.advantage_clipped},
                "gate": {"verdict": gate["verdict"], "forced": self.prior.forced, "reasons": gate["reasons"],
                         "advice": gate["info"].get("recommendation")},
                "envelope": loop.settings.envelope.model_dump(), "sft_adapter": str(adapter) if adapter else None,
                "reward_model": str(reward_model) if reward_model else None, "world_size": self.world.size,
                "replica_digests": replicas, "replicas_identical": len(set(replicas)) == 1}


def _reward_status(metrics: dict) -> str:
    return f"reward {metrics['reward/mean']:.3f}"


def _watchdog_figures(watch: Optional[WatchedRun], last: Optional[dict], events: list[dict], steps: int) -> dict:
    """The manifest's watchdog record: off (the last iteration, ``steps``, published), or the
    published (best) iteration, the last one, events, stop reason."""
    if watch is None:
        return {"enabled": False, "published_step": steps}
    summary = watch.watchdog.summary()
    return dict(summary, published_step=summary["best_step"], last=last, events=len(events),
                detectors=sorted({event["detector"] for event in events}), seconds=round(watch.seconds, 3))
