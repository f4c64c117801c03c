"""PPO for a language model with a value head, inside the safety envelope. One iteration, top to bottom:

1. prompts: ``prompts_per_step * group_size`` distinct training prompts, one completion each;
2. rollout: sample, score, and recompute old/reference log-probabilities and values in fp32;
3. advantages: whiten the scores, sigma-clip them, spread them into per-token rewards with a KL penalty, GAE,
   whiten and sigma-clip the advantages;
4. loss, per minibatch (through the shared guarded step): the clipped policy loss (token mean), the clipped value
   loss, and optionally the k3 KL in the loss instead of the reward;
5. the adaptive KL controller, then the metrics (explained variance of the value head among them).

After Schulman et al. 2017 (PPO) and Ziegler et al. 2019 (PPO for language models), as TRL's PPOTrainer.
"""

from __future__ import annotations

import time

import torch

from slm_align.envelope.seeds import derive_seed
from slm_align.rl.advantages import gae, masked_mean, masked_whiten, per_token_rewards, sigma_clip, whiten_scores
from slm_align.rl.losses import adaptive_kl_coef, clipped_policy_loss, clipped_value_loss, kl_k3
from slm_align.rl.phases import PhaseClock
from slm_align.rl.rollout import Rollout
from slm_align.rl.schedule import iteration_size
from slm_align.rl.step import Learner, LossFn, rollout_kl, rollout_metrics


class PPO(Learner):
    """PPO's iteration on the shared run state (:class:`slm_align.rl.step.Learner`); needs a value head."""

    def prompts_for(self, step: int) -> list[str]:
        """This rank's training prompts of an iteration, chosen by (seed, step): a resumed run sees the same ones."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", step))
        draws = iteration_size(self.settings).prompts
        picks = torch.randint(len(self.train_prompts), (draws,), generator=generator).tolist()
        picks = picks[self.world.rank::self.world.size]
        return [self.train_prompts[i] for i in picks]

    def rollout(self, step: int) -> Rollout:
        """One completion per prompt, scored, with old and reference log-probabilities and values."""
        seed = derive_seed(self.seed, "rollout", step, self.world.rank)
        return self.sample_rollout(self.prompts_for(step), seed)

    def advantages(self, batch: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token advantages and returns, (B, T) each, whitened and sigma-clipped as the envelope says."""
        ppo = self.settings.ppo
        n_sigma = self.envelope.sigma_clip
        scores = batch.scores
        if ppo.whiten_rewards:
            scores = whiten_scores(scores)
        scores, clipped = sigma_clip(scores, n_sigma)
        self.counters.score_clipped += clipped
        kl_coef = self.kl_coef if ppo.kl_mode == "reward" else 0.0  # k1 in the reward, or k3 in the loss
        rewards = per_token_rewards(scores, batch.old_logprobs, batch.ref_logprobs, batch.mask, kl_coef)
        advantages, returns = gae(rewards, batch.values, batch.mask, ppo.gamma, ppo.lam)
        advantages, clipped = sigma_clip(masked_whiten(advantages, batch.mask), n_sigma, batch.mask)
        self.counters.advantage_clipped += clipped
        return advantages, returns

    def loss(self, batch: Rollout, advantages: torch.Tensor, returns: torch.Tensor) -> LossFn:
        """PPO's loss on a minibatch: clipped policy loss + value_coef * clipped value loss (+ kl_coef * k3)."""
        s = self.settings

        def loss_fn(rows, new_logprobs, values, ratio, mask):
            """PPO's loss on ``rows`` (see :data:`slm_align.rl.step.LossFn`) and its statistics."""
            loss, clip_frac = clipped_policy_loss(ratio, advantages[rows], mask, s.clip_eps, s.clip_eps,
                                                  "token_mean", s.max_new_tokens)
            stats = {"loss/policy": float(loss.detach()), "clip_frac": float(clip_frac)}
            value_loss = clipped_value_loss(values, batch.values[rows], returns[rows], mask, s.ppo.value_clip)
            loss = loss + s.ppo.value_coef * value_loss
            stats["loss/value"] = float(value_loss.detach())
            if s.ppo.kl_mode == "loss":
                kl = kl_k3(new_logprobs, batch.ref_logprobs[rows], self.envelope.log_ratio_clamp)
                loss = loss + self.kl_coef * masked_mean(kl, mask)
            return loss, stats

        return loss_fn

    def run_step(self, step: int) -> dict:
        """One PPO iteration: rollout, advantages, guarded updates, the KL controller; the iteration's metrics."""
        started = time.perf_counter()
        self.clock = PhaseClock()
        batch = self.rollout(step)
        self.require_training_tokens(batch, step)
        advantages, returns = self.advantages(batch)
        results = self.update(batch, self.loss(batch, advantages, returns), step)
        self.step = step + 1
        kl = rollout_kl(batch)
        if self.settings.ppo.adaptive_kl:
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl, self.settings.ppo.target_kl)
        metrics = rollout_metrics(batch, results, kl, time.perf_counter() - started)
        metrics["value/explained_variance"] = explained_variance(returns, batch.values, batch.mask)
        metrics.update(self.guard_metrics())
        metrics.update(self.clock.metrics())
        return metrics


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the returns' variance the value head explains: 1 - Var[R - V] / Var[R], over ``mask``.

    returns, values, mask: (B, T). Here Var[R - V] is the mean squared error E[(R - V)^2] (not centred) and
    Var[R] the population variance of R; 1 is a perfect critic, 0 one no better than the mean return, negative
    worse. 0.0 when R is constant. As CleanRL's ``ppo.py`` and TRL's PPOTrainer log it.
    """
    residual = masked_mean((returns - values) ** 2, mask)
    variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    return float(1 - residual / variance) if variance > 0 else 0.0
