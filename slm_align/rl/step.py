"""The guarded optimizer step PPO and GRPO share, and the run state around it.

One minibatch step, in order: snapshot (trainable parameters and optimizer state), forward (dropout off), the
fp32 importance ratio with its log-ratio clamped, the ratio guard (a minibatch whose world-wide mean ratio exceeds
the envelope's bound is skipped: no backward, no step), the algorithm's loss (passed in as a function), a finite
loss, backward, :meth:`Learner.after_backward`, gradient averaging across data-parallel ranks, a finite gradient,
the gradient-norm clip, the optimizer step, finite parameters. Any non-finite value restores the snapshot bit for
bit and is counted; too many rollbacks in a row stop the run.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from slm_align.config import RLSettings
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.envelope.ratio import ratio_of
from slm_align.envelope.run import TrainableRun
from slm_align.envelope.seeds import derive_seed
from slm_align.envelope.value_head import ValueHead
from slm_align.envelope.world import World
from slm_align.errors import UserError
from slm_align.rl.advantages import masked_mean
from slm_align.rl.phases import PhaseClock
from slm_align.rl.rollout import Rollout, collect

LossFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor],
                  tuple[torch.Tensor, dict]]
"""An algorithm's loss on one minibatch: ``(rows, new_logprobs, values, ratio, mask) -> (loss, statistics)``.

rows: (b,) indices into the rollout; new_logprobs, ratio, mask: (b, T); values: (b, T) or None (no value head)."""


class Learner(TrainableRun):
    """One RL run's state: the shared trainable run (policy, optimizer, guard, step; rl/trainable.py), the optional
    value head, the prompts, the reward and the KL coefficient.

    PPO and GRPO subclass it and add the rollout, advantages and loss of their iteration (``run_step``).
    """

    def __init__(self, policy, tokenizer, reward_fn, train_prompts: list[str], settings: RLSettings, seed: int,
                 value_head: Optional[ValueHead] = None, world: World = World(), precision: str = "fp32",
                 checkpointing: bool = False):
        named_params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        if value_head is not None:
            named_params += [(f"value_head.{n}", p) for n, p in value_head.named_parameters()]
        super().__init__(policy, named_params, settings.learning_rate, settings.envelope, world, precision,
                         checkpointing)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.train_prompts = train_prompts
        self.settings = settings
        self.seed = seed
        self.value_head = value_head
        # PPO's (adaptive) KL coefficient. GRPO weighs its KL by grpo.beta and carries this value unchanged, so
        # that both write the same checkpoint and the same "kl_coef" metric.
        self.kl_coef = settings.ppo.kl_coef
        self.clock = PhaseClock()
        """The current iteration's phase timings (a fresh clock each iteration)."""
        self.kl_watched = False
        """Whether something reads the "kl" metric besides the loss (the watchdog's KL-runaway detector)."""

    # ---- the guarded step ----------------------------------------------------------------------------------
    def sample_rollout(self, prompts: list[str], seed: int) -> Rollout:
        """One completion per prompt, scored, with the old and reference log-probabilities the algorithm uses
        (values under PPO); the phases timed on :attr:`clock`."""
        with self.forward_context():
            return collect(self.policy, self.value_head, self.tokenizer, self.reward_fn, prompts, self.settings, seed,
                           self.clock, self.needs_old_pass(), self.needs_reference())

    def needs_old_pass(self) -> bool:
        """Whether the rollout scores old log-probabilities in a pass of their own before any update (PPO's advantages
        and values need them: always; GRPO overrides)."""
        return True

    def needs_reference(self) -> bool:
        """Whether the rollout scores reference log-probabilities (PPO's KL: always; GRPO overrides)."""
        return True

    def minibatch(self, batch: Rollout, rows: torch.Tensor, loss_fn: LossFn) -> dict:
        """One guarded optimizer step on ``rows`` of the batch with the algorithm's ``loss_fn``; its statistics."""
        env = self.envelope
        with self.clock.phase("update_forward"):
            snapshot = self.guard.snapshot()
            self.prepare_forward()
            with self.forward_context():
                new, entropy, values = forward_logprobs(self.policy, batch.input_ids[rows],
                                                        batch.attention_mask[rows], batch.prompt_width,
                                                        self.settings.temperature, self.value_head)
            mask = batch.mask[rows]
            ratio = ratio_of(new, old_logprobs(batch, rows, new), env.log_ratio_clamp)
            stats = {"ratio/mean": float(masked_mean(ratio.detach(), mask)),
                     "ratio/max": float((ratio.detach() * mask).max()),
                     "entropy": float(masked_mean(entropy, mask))}
            if env.ratio_guard and self.world.mean(stats["ratio/mean"]) > env.ratio_guard:
                self.counters.skipped += 1  # no backward, no optimizer step: parameters and state stay as they are
                return dict(stats, skipped=1)
            loss, loss_stats = loss_fn(rows, new, values, ratio, mask)
        stats.update(loss_stats)
        with self.clock.phase("update_backward"):
            return dict(stats, skipped=0, **self.guard.step(loss, snapshot, self.after_backward))

    def update(self, batch: Rollout, loss_fn: LossFn, step: int) -> list[dict]:
        """``epochs`` passes over the rollout in shuffled minibatches, one guarded step each; their statistics."""
        size = batch.scores.shape[0]
        results = []
        for epoch in range(self.settings.epochs):
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "minibatch_order", step, epoch=epoch))
            order = torch.randperm(size, generator=generator)
            for start in range(0, size, self.settings.minibatch_size):
                results.append(self.minibatch(batch, order[start:start + self.settings.minibatch_size], loss_fn))
        return results

    # ---- around the iteration ------------------------------------------------------------------------------
    def require_training_tokens(self, batch: Rollout, step: int) -> None:
        """Stop when no completion token of the rollout trains (on every rank): an update would only replay AdamW's
        stale momentum on a zero gradient."""
        if not self.world.all(float(batch.mask.sum()) == 0):
            return
        budget = self.settings.max_new_tokens
        raise UserError(f"RL iteration {step + 1}: every completion ran to max_new_tokens={budget} without EOS and "
                        "--mask-truncated gives truncated completions no gradient, so nothing would train; raise "
                        "--max-new-tokens or drop --mask-truncated")

    def guard_metrics(self) -> dict:
        """The iteration count, the KL coefficient and what the guards did so far (totals of the run)."""
        return {"step": self.step, "kl_coef": self.kl_coef, "guard/skipped": self.counters.skipped,
                "guard/rollbacks": self.counters.rollbacks, "guard/score_clipped": self.counters.score_clipped,
                "guard/advantage_clipped": self.counters.advantage_clipped}

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit (trainable weights, AdamW, RNG, counters)."""
        return dict(self.run_state(), kl_coef=self.kl_coef)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`."""
        self.load_run_state(state)
        self.kl_coef = state["kl_coef"]


def old_logprobs(batch: Rollout, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(b, T) log-probabilities of ``rows`` under the rollout policy: the old pass's, or, when the rollout skipped
    that pass (one minibatch per epoch), the first epoch's forward's own ``new`` detached, kept in the batch for the
    later epochs and the KL metric. Those are the rollout policy's exactly (no step has been taken yet), so the
    first epoch's ratio is exactly 1."""
    if batch.old_logprobs is not None:
        return batch.old_logprobs[rows]
    if rows.numel() != batch.mask.shape[0]:
        raise ValueError("a rollout without old log-probabilities trains in one minibatch of all its rows")
    old = torch.zeros_like(batch.mask)
    old[rows] = new.detach().float()
    batch.old_logprobs = old
    return old[rows]


def rollout_kl(batch: Rollout) -> Optional[float]:
    """Mean over sequences of the summed k1 KL, sum_t (log pi_old - log pi_ref) * m_t: the run's "kl" metric and
    the adaptive controller's input; None when the rollout has no reference log-probabilities."""
    if batch.ref_logprobs is None:
        return None
    return float(((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum(-1).mean())


def _mean(results: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in results if key in r]
    return sum(values) / len(values) if values else None


def rollout_metrics(batch: Rollout, results: list[dict], kl: float, seconds: float) -> dict:
    """The metrics both algorithms log: reward, KL, lengths, and the minibatch statistics averaged."""
    lengths = batch.lengths.float()
    metrics = {"reward/mean": float(batch.scores.mean()), "reward/std": float(batch.scores.std()),
               "kl": kl, "completion/length": float(lengths.mean()),
               "completion/truncated_frac": float(batch.truncated.float().mean()),
               "ratio/max": max(r["ratio/max"] for r in results), "step_time": seconds,
               "tokens_per_s": float(lengths.sum()) / seconds if seconds else 0.0}
    for key in ("ratio/mean", "entropy", "clip_frac", "loss/policy", "loss/value", "grad_norm"):
        metrics[key] = _mean(results, key)
    return metrics
