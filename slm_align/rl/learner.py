"""What PPO (rl/ppo.py) and GRPO (rl/grpo.py) share: the run state, and the pieces of a minibatch
that both call.

The run state (:class:`Learner`): the envelope's trainable run (policy, AdamW, the guard, the
step), the value head, the prompts, the reward, the KL coefficient, the phase clock, the metrics
and the checkpoint. The algorithms own their iteration and their epoch and minibatch loop, and
each minibatch hands its loss (a function of one micro-batch's forward) to
:meth:`Learner.guarded_update`: the snapshot, then per micro-batch :meth:`Learner.policy_forward`
(forward with dropout off, the fp32 importance ratio), the loss and its backward, then the ratio
guard (:meth:`Learner.ratio_guard_skips`) and the guarded optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from slm_align.config import RLSettings
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.envelope.policy import policy_rewards
from slm_align.envelope.ratio import ratio_guard_trips, ratio_of
from slm_align.envelope.run import Placement, TrainableRun
from slm_align.envelope.seeds import derive_seed
from slm_align.envelope.value_head import ValueHead
from slm_align.errors import UserError
from slm_align.progress import Count, counted, say_line
from slm_align.rl.advantages import masked_mean
from slm_align.rl.losses import Whole
from slm_align.rl.sampler_correction import sampler_mismatch, sampler_weights
from slm_align.rl.schedule import IterationSize
from slm_align.rollouts.completions import Passes, Rollout, RolloutModels, collect
from slm_align.rollouts.episodes import AgentTasks, collect_episodes, episode_rewards
from slm_align.rollouts.phases import PhaseClock

if TYPE_CHECKING:  # annotations only: the learner runs without llama.cpp
    from slm_align.rl.llama_sampler import LlamaSampler


@dataclass(frozen=True)
class RolloutSource:
    """What a learner's rollouts are drawn from, built once before the learner: the training
    prompts, the agent tasks whose rollouts are multi-turn episodes run by the runtime's loop
    (None: one completion per prompt), and the llama.cpp sampler that draws them (None: PyTorch
    does)."""

    prompts: list[str]
    episodes: Optional[AgentTasks] = None
    sampler: Optional[LlamaSampler] = None


@dataclass
class PolicyForward:
    """b rollout rows (T completion tokens) under the current policy."""

    rows: torch.Tensor  # (b,) indices into the rollout
    logprobs: torch.Tensor  # (b, T) log pi(y_t), with gradient
    values: Optional[torch.Tensor]  # (b, T) the value head's V_t, with gradient; None without one
    ratio: torch.Tensor  # (b, T) fp32 importance ratio rho_t
    mask: torch.Tensor  # (b, T) completion tokens that train
    stats: dict  # "ratio/mean", "ratio/max", "entropy"
    weights: Optional[torch.Tensor] = None  # (b, T) or (b, 1): the sampler correction (None: PyTorch sampled)


MicroLoss = Callable[[PolicyForward, Whole], tuple[torch.Tensor, dict]]
"""An algorithm's loss on one micro-batch's forward, normalised by its whole minibatch, and its
statistics ("loss/..." figures already divided by the whole; others means over its tokens)."""


class Learner(TrainableRun):
    """One RL run's state: the envelope's trainable run (envelope/run.py), the optional value head,
    the prompts, the reward and the KL coefficient. PPO and GRPO subclass it with their iteration
    (``run_step``) and say what they need: a value head or not, and how their KL is weighed and raised."""

    needs_value_head = False
    """The stage builds a value head beside the policy for this algorithm (PPO's critic)."""

    draw_unit = "samples"
    """What ranks share of an iteration's draws, as messages name it (GRPO: "prompts", whole
    groups)."""

    @classmethod
    def iteration_size(cls, settings: RLSettings) -> IterationSize:
        """How many prompts an iteration draws and how many completions each gets (no model
        needed: the pipeline and the quickstart ask before any learner exists)."""
        raise NotImplementedError

    def kl_weight(self) -> float:
        """The weight the algorithm's loss or reward puts on the KL to the reference now."""
        raise NotImplementedError

    def raise_kl(self, factor: float, base_beta: float, scale: float) -> None:
        """The watchdog's answer to a KL runaway: weigh the KL more. ``factor`` multiplies a coefficient the
        learner keeps in its own state; ``base_beta * scale`` replaces a coefficient of the recipe."""
        raise NotImplementedError

    def rescale_kl(self, base_beta: float, scale: float) -> None:
        """After a rollback: a recipe coefficient is ``base_beta * scale`` (a learner state's is restored)."""

    def __init__(self, policy, tokenizer, reward_fn, rollouts: RolloutSource,
                 settings: RLSettings, seed: int, value_head: Optional[ValueHead] = None,
                 placement: Placement = Placement()):
        named_params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        if value_head is not None:
            named_params += [(f"value_head.{n}", p) for n, p in value_head.named_parameters()]
        super().__init__(policy, named_params, settings.learning_rate, settings.envelope, placement)
        self.warmup_steps = settings.warmup_steps
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.train_prompts = rollouts.prompts
        self.settings = settings
        self.seed = seed
        self.value_head = value_head
        # PPO's (adaptive) KL coefficient. GRPO weighs its KL by grpo.beta and carries this value
        # unchanged, so that both write the same checkpoint and the same "kl_coef" metric.
        self.kl_coef = settings.ppo.kl_coef
        self.clock = PhaseClock()
        """The current iteration's phase timings (a fresh clock each iteration)."""
        self.kl_watched = False
        """Whether something reads the "kl" metric besides the loss (the watchdog's KL detector)."""
        self.sampler = rollouts.sampler
        """A :class:`~slm_align.rl.llama_sampler.LlamaSampler` that draws the rollouts (None:
        PyTorch does)."""
        self.episodes = rollouts.episodes
        """Agent tasks whose rollouts are multi-turn episodes run by the runtime's loop (None: one
        completion per prompt)."""
        self.update_count = Count(None, None)
        """The running iteration's update count (:meth:`minibatches`; inactive outside it)."""

    def collect_rollout(self, prompts: list[str], seed: int, passes: Passes = Passes()) -> Rollout:
        """One completion (or, with agent tasks, one episode) per prompt, scored, with the old and
        reference log-probabilities the algorithm asks for in ``passes`` (values under PPO), timed
        on the clock; ``passes.old_from_sampler``: single completions sampled by PyTorch take their
        old log-probabilities from the sampler
        (:func:`~slm_align.rollouts.completions.sampled_old_logprobs`)."""
        models = RolloutModels(self.policy, self.value_head, self.tokenizer, self.reward_fn,
                               self.sampler)
        with self.forward_context():
            if self.episodes is not None:
                return collect_episodes(models, prompts, self.settings, seed, self.episodes,
                                        self.clock, passes)
            return collect(models, prompts, self.settings, seed, self.clock, passes)

    def sample_rewards(self, prompts: list[str], seed: int, adapter: bool = True) -> list[float]:
        """The reward of one completion (or episode) per prompt sampled with ``seed``, the RL adapter on
        or off (the prior): what the held-out reward and the watchdog's probe measure."""
        if self.episodes is not None:
            return episode_rewards(self.policy, self.tokenizer, self.reward_fn, prompts, self.settings, seed,
                                   self.episodes, adapter)
        return policy_rewards(self.policy, self.tokenizer, self.reward_fn, prompts, self.settings, seed, adapter)

    def token_budget(self) -> int:
        """The most sampled tokens one rollout row can hold (Dr. GRPO's constant normaliser):
        ``max_new_tokens``, times the rounds of an agent episode (its tool rounds and the answer)."""
        rounds = self.settings.max_tool_rounds + 1 if self.episodes is not None else 1
        return self.settings.max_new_tokens * rounds

    def prompts_for(self, step: int) -> list[str]:
        """This rank's training prompts of an iteration, chosen by (seed, step) so that a resumed
        run sees the same ones: this rank's share of the iteration's draws (whole GRPO groups),
        each repeated ``completions_per_prompt`` times in a row (GRPO: a group; PPO: once)."""
        size = self.iteration_size(self.settings)
        picks = self.draw_prompts(derive_seed(self.seed, "prompts", step), size.prompts)
        return [prompt for prompt in picks[self.world.rank::self.world.size]
                for _ in range(size.completions_per_prompt)]

    def draw_prompts(self, seed: int, count: int) -> list[str]:
        """``count`` training prompts drawn uniformly with replacement by ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        draws = torch.randint(len(self.train_prompts), (count,), generator=generator)
        return [self.train_prompts[i] for i in draws.tolist()]

    def require_training_tokens(self, batch: Rollout, step: int) -> None:
        """Stop when no completion token of the rollout trains (on every rank): an update would
        only replay AdamW's stale momentum on a zero gradient."""
        if not self.world.all(float(batch.mask.sum()) == 0):
            return
        raise UserError(f"RL iteration {step + 1}: every completion ran to max_new_tokens="
                        f"{self.settings.max_new_tokens} without EOS and --mask-truncated gives "
                        "truncated completions no gradient, so nothing would train; raise "
                        "--max-new-tokens or drop --mask-truncated")

    # ---- the pieces of a minibatch -----------------------------------------------------------
    def minibatches(self, batch: Rollout, step: int) -> Iterator[torch.Tensor]:
        """The (b,) rows of each minibatch of an iteration: ``epochs`` passes over the rollout,
        each a seeded shuffle ("minibatch_order" at step and epoch) cut into ``minibatch_size``;
        the step's update counted (:func:`~slm_align.progress.counted`) in micro-batches, which
        :meth:`micro_batched_step` advances (a log hears from a long update every micro-batch; an
        out-of-memory retry counts its micro-batches again)."""
        size = self.settings.minibatch_size
        micro = self.settings.micro_batch_size or size
        per_epoch = sum(-(-min(size, batch.size - start) // micro) for start in range(0, batch.size, size))
        with counted("update", self.settings.epochs * per_epoch, "micro-batches") as count:
            self.update_count = count
            try:
                for epoch in range(self.settings.epochs):
                    seed = derive_seed(self.seed, "minibatch_order", step, epoch=epoch)
                    order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
                    for start in range(0, batch.size, size):
                        yield order[start:start + size]
            finally:
                self.update_count = Count(None, None)

    def micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """A minibatch's (b,) rows cut into ``micro_batch_size`` (all of them when None)."""
        size = self.settings.micro_batch_size or rows.numel()
        return list(rows.split(size))

    def guarded_update(self, batch: Rollout, rows: torch.Tensor, loss_of: MicroLoss) -> dict:
        """One guarded optimizer step on ``rows`` (b,) of the rollout; its statistics.

        The snapshot (nothing has moved yet); then each micro-batch of the rows
        (:meth:`micro_batches`): its forward (:meth:`policy_forward`), its share of the minibatch's
        loss, ``loss_of(forward, whole)`` (normalised by the whole minibatch), and its backward
        (gradients add up; its activations are freed before the next forward); then the ratio
        guard on the minibatch's mean ratio, which drops the gradients of a tripped minibatch (no
        step); then the guarded step. A non-finite loss rolls back before its backward.

        Out of memory (``torch.OutOfMemoryError``: CUDA's, or an allocation the host refused), the
        minibatch starts again from the snapshot in micro-batches half as large, said in one line
        (:meth:`halve_micro_batches`), as accelerate's ``find_executable_batch_size`` does for a
        Trainer. A host whose kernel kills the process instead (Linux overcommit) gives no such
        chance: set ``--micro-batch-size`` there."""
        snapshot = self.guard.snapshot()
        fills_old = batch.old_logprobs is None
        while True:
            try:
                return self.micro_batched_step(batch, rows, loss_of, snapshot, fills_old)
            except torch.OutOfMemoryError:
                if snapshot is not None:
                    snapshot.restore()
                batch.old_logprobs = None if fills_old else batch.old_logprobs
                self.halve_micro_batches(rows.numel())  # the next try begins with no gradient

    def halve_micro_batches(self, rows: int) -> None:
        """After running out of memory: ``micro_batch_size`` halved for the rest of the run, said in
        one line; at one row already, a clear stop instead."""
        size = self.settings.micro_batch_size or rows
        if size <= 1:
            raise UserError("RL update: out of memory with one row at a time; use --gradient-checkpointing, "
                            "a smaller --max-new-tokens or a smaller model")
        half = size // 2
        self.settings = self.settings.model_copy(update={"micro_batch_size": half})
        say_line(f"RL update: out of memory with {size} rows at a time; now {half} "
                 f"(--micro-batch-size {half} starts there)")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def micro_batched_step(self, batch: Rollout, rows: torch.Tensor, loss_of: MicroLoss, snapshot,
                           fills_old: bool) -> dict:
        """:meth:`guarded_update`'s one try at the current ``micro_batch_size``."""
        whole = Whole.of(batch.mask[rows])
        if fills_old:
            batch.old_logprobs = empty_old_logprobs(batch, rows)
        self.guard.begin()
        parts, losses = [], []
        for micro in self.micro_batches(rows):
            forward = self.policy_forward(batch, micro, fills_old)
            with self.clock.phase("update_forward"):
                loss, stats = loss_of(forward, whole)
            with self.clock.phase("update_backward"):
                if not self.guard.backward(loss):
                    batch.old_logprobs = None if fills_old else batch.old_logprobs
                    return self.guard.roll_back(snapshot, "non-finite loss")
            parts.append((dict(forward.stats, **stats), float(forward.mask.sum())))
            losses.append(float(loss.detach()))
            self.update_count.advance()
        stats = merged_stats(parts)
        if self.ratio_guard_skips(stats):
            self.guard.begin()
            return dict(stats, skipped=1)
        with self.clock.phase("update_backward"):
            result = self.guard.finish(sum(losses), snapshot, self.after_backward)
        return dict(stats, skipped=0, **result)

    def policy_forward(self, batch: Rollout, rows: torch.Tensor, fills_old: bool = False) -> PolicyForward:
        """``rows`` of the rollout under the current policy, timed as "update_forward": the forward
        with dropout off (autocast at the run's precision), then in fp32 the importance ratio, (b, T),

            rho_t = exp(clamp(log pi(y_t) - log pi_old(y_t), -c, c)),  c = log_ratio_clamp

        (:func:`~slm_align.envelope.ratio.ratio_of`), its masked mean and max, the mean entropy.
        ``fills_old``: the rollout has no old log-probabilities of its own and no step has been
        taken since it was drawn; this forward's, detached, are written as the old ones
        (:func:`old_logprobs`)."""
        with self.clock.phase("update_forward"):
            self.prepare_forward()
            with self.forward_context():
                new, entropy, values = forward_logprobs(
                    self.policy, batch.input_ids[rows], batch.attention_mask[rows],
                    batch.prompt_width, self.settings.temperature, self.value_head)
            mask = batch.mask[rows]
            old = old_logprobs(batch, rows, new, fills_old)
            ratio = ratio_of(new, old, self.envelope.log_ratio_clamp)
            stats = {"ratio/mean": float(masked_mean(ratio.detach(), mask)),
                     "ratio/max": float((ratio.detach() * mask).max()),
                     "entropy": float(masked_mean(entropy, mask))}
            weights = None
            if batch.sampler_logprobs is not None:
                s = self.settings
                weights = sampler_weights(old, batch.sampler_logprobs[rows], mask, s.sampler_cap, s.sampler_correction)
        return PolicyForward(rows, new, values, ratio, mask, stats, weights)

    def sampler_figures(self, batch: Rollout) -> dict:
        """The sampler-trainer mismatch of the rollout (:func:`sampler_mismatch`); none when PyTorch sampled."""
        if batch.sampler_logprobs is None or batch.old_logprobs is None:
            return {}
        s = self.settings
        return sampler_mismatch(batch.old_logprobs, batch.sampler_logprobs, batch.mask, s.sampler_cap,
                                s.sampler_correction)

    def ratio_guard_skips(self, stats: dict) -> bool:
        """The ratio guard (envelope rule 5): whether the minibatch's mean ratio (``stats``), averaged
        over ranks, exceeds ``envelope.ratio_guard`` (0: off). A trip is counted; the caller skips the
        minibatch: its gradients dropped, no optimizer step, parameters and optimizer state as they are."""
        bound = self.envelope.ratio_guard
        if not bound or not ratio_guard_trips(self.world.mean(stats["ratio/mean"]), bound):
            return False
        self.counters.skipped += 1
        return True

    # ---- metrics and checkpoints -------------------------------------------------------------
    def run_metrics(self) -> dict:
        """The iteration count, the KL coefficient, the learning rate of the iteration's updates, what
        the guards did so far (totals of the run) and the iteration's phase timings."""
        counters = self.counters
        rate = self.optimizer.param_groups[0]["lr"]
        return {"step": self.step, "kl_coef": self.kl_coef, "learning_rate": rate, "guard/skipped": counters.skipped,
                "guard/rollbacks": counters.rollbacks,
                "guard/score_clipped": counters.score_clipped,
                "guard/advantage_clipped": counters.advantage_clipped, **self.clock.metrics()}

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit (trainable weights, AdamW, RNG,
        counters, the KL coefficient)."""
        return dict(self.run_state(), kl_coef=self.kl_coef)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        self.load_run_state(state)
        self.kl_coef = state["kl_coef"]


def empty_old_logprobs(batch: Rollout, rows: torch.Tensor) -> torch.Tensor:
    """(B, T) zeros for the old log-probabilities the first minibatch's forward writes, when the
    rollout skipped their pass: that minibatch must hold every row (one minibatch per epoch)."""
    if rows.numel() != batch.mask.shape[0]:
        raise ValueError("a rollout without old log-probabilities trains in one "
                         "minibatch of all its rows")
    return torch.zeros_like(batch.mask)


def old_logprobs(batch: Rollout, rows: torch.Tensor, new: torch.Tensor, fills: bool = False) -> torch.Tensor:
    """(b, T) log-probabilities of ``rows`` under the rollout policy: the old pass's, or, when the
    rollout skipped that pass (``fills``: one minibatch per epoch), the first epoch's forward's own
    ``new`` detached, written into the batch for the later epochs and the KL metric. Those are the
    rollout policy's exactly (no step has been taken yet), so the first epoch's ratio is exactly 1."""
    if fills:
        batch.old_logprobs[rows] = new.detach().float()
    return batch.old_logprobs[rows]


SUMMED = ("loss/policy", "loss/value")
"""Statistics a micro-batch reports already divided by its whole minibatch: the minibatch's is the sum."""


def merged_stats(parts: list[tuple[dict, float]]) -> dict:
    """A minibatch's statistics from its micro-batches' (each with its trained tokens): the
    "loss/..." figures summed, "ratio/max" the largest, the rest token-weighted means (masked means
    over the minibatch, as one forward of all rows gives them). One part: its own figures."""
    if len(parts) == 1:
        return parts[0][0]
    total = sum(tokens for _, tokens in parts)
    merged = {}
    for key in parts[0][0]:
        values = [figures[key] for figures, _ in parts]
        if key in SUMMED:
            merged[key] = sum(values)
        elif key == "ratio/max":
            merged[key] = max(values)
        else:
            weighted = sum(value * tokens for value, (_, tokens) in zip(values, parts))
            merged[key] = weighted / total if total else 0.0
    return merged


def rollout_kl(batch: Rollout) -> Optional[float]:
    """Mean over sequences of the summed k1 KL, sum_t (log pi_old - log pi_ref) * m_t: the run's
    "kl" metric and the adaptive controller's input; None without reference log-probabilities."""
    if batch.ref_logprobs is None:
        return None
    return float(((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum(-1).mean())


def _mean(results: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in results if key in r]
    return sum(values) / len(values) if values else None


def rollout_metrics(batch: Rollout, results: list[dict], kl: Optional[float],
                    seconds: float) -> dict:
    """The metrics both algorithms log: reward, KL, lengths (``completion/length``: tokens sampled per
    round, :attr:`~slm_align.rollouts.completions.Rollout.round_lengths`), the minibatch statistics averaged."""
    lengths = batch.lengths.float()
    metrics = {**batch.stats, "reward/mean": float(batch.scores.mean()), "reward/std": float(batch.scores.std()),
               "kl": kl, "completion/length": float(batch.round_lengths.mean()),
               "completion/truncated_frac": float(batch.truncated.float().mean()),
               "ratio/max": max(r["ratio/max"] for r in results), "step_time": seconds,
               "tokens_per_s": float(lengths.sum()) / seconds if seconds else 0.0}
    for key in ("ratio/mean", "entropy", "clip_frac", "loss/policy", "loss/value", "grad_norm"):
        metrics[key] = _mean(results, key)
    return metrics
