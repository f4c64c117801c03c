"""PPO for a language model with a value head, inside the safety envelope.

One iteration, top to bottom:

1. prompts: ``prompts_per_step * group_size`` distinct training prompts, one completion each;
2. rollout: sample, score, and recompute old/reference log-probabilities and values in fp32;
3. advantages: whiten the scores, sigma-clip them, spread them into per-token rewards with a KL
   penalty, GAE, whiten and sigma-clip the advantages;
4. update: ``epochs`` passes in shuffled minibatches, each in micro-batches: the ratio, the loss
   (the clipped policy loss, token mean over the minibatch; the clipped value loss; optionally the
   k3 KL in the loss instead of the reward) and its backward; then the ratio guard, the guarded
   optimizer step;
5. the adaptive KL controller, then the metrics (the value head's explained variance among them).

After Schulman et al. 2017 (PPO) and Ziegler et al. 2019 (PPO for language models), as TRL's
PPOTrainer; laid out as CleanRL's ``ppo.py``.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from slm_align.config import RLSettings
from slm_align.envelope.seeds import derive_seed
from slm_align.rl.advantages import (
    Advantages,
    gae_over_trained,
    masked_mean,
    masked_whiten,
    sigma_clip,
    whiten_scores,
)
from slm_align.rl.learner import Learner, PolicyForward, rollout_kl, rollout_metrics
from slm_align.rl.losses import (
    Whole,
    adaptive_kl_coef,
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    kl_k3,
)
from slm_align.rl.schedule import IterationSize
from slm_align.rollouts.completions import Rollout
from slm_align.rollouts.phases import PhaseClock


class PPO(Learner):
    """PPO's iteration on the shared run state (:class:`slm_align.rl.learner.Learner`); needs a
    value head."""

    needs_value_head = True

    @classmethod
    def iteration_size(cls, settings: RLSettings) -> IterationSize:
        """``prompts_per_step * group_size`` prompts, one completion each: as many samples as
        GRPO's groups, from distinct prompts."""
        return IterationSize(settings.prompts_per_step * settings.group_size, 1)

    def kl_weight(self) -> float:
        """The adaptive KL coefficient, kept in the learner's state (and checkpoint)."""
        return self.kl_coef

    def raise_kl(self, factor: float, base_beta: float, scale: float) -> None:
        self.kl_coef *= factor

    def rescale_kl(self, base_beta: float, scale: float) -> None:
        """Nothing: the coefficient came back with the learner's state."""

    def rollout(self, step: int) -> Rollout:
        """B completions of B distinct prompts, scored, with old and reference log-probabilities
        and values."""
        seed = derive_seed(self.seed, "rollout", step, self.world.rank)
        return self.collect_rollout(self.prompts_for(step), seed)

    def advantages(self, batch: Rollout) -> Advantages:
        """Per-token advantages and returns, (B, T) each, whitened and sigma-clipped.

        s = clip3sigma(whiten(scores)) over the batch; r_t = -kl_coef * (log pi_old - log pi_ref)
        on every token plus s on the last (:func:`per_token_rewards`; kl_coef 0 when the KL goes
        into the loss); A, R = GAE(r, V, gamma, lambda) (:func:`gae`); A = clip3sigma(whiten(A))
        over the mask. The clips are counted (``guard/score_clipped``, ``guard/advantage_clipped``).
        """
        ppo = self.settings.ppo
        n_sigma = self.envelope.sigma_clip
        scores = whiten_scores(batch.scores) if ppo.whiten_rewards else batch.scores
        scores, clipped = sigma_clip(scores, n_sigma)
        self.counters.score_clipped += clipped
        kl_coef = self.kl_coef if ppo.kl_mode == "reward" else 0.0  # k1 here, or k3 in the loss
        advantages, returns = gae_over_trained(scores, batch.old_logprobs, batch.ref_logprobs, batch.values,
                                               batch.mask, kl_coef, ppo.gamma, ppo.lam)
        advantages, clipped = sigma_clip(masked_whiten(advantages, batch.mask), n_sigma, batch.mask)
        self.counters.advantage_clipped += clipped
        return Advantages(advantages, returns)

    def minibatch(self, batch: Rollout, rows: torch.Tensor, adv: Advantages) -> dict:
        """One guarded optimizer step on ``rows`` (b,) of the rollout, in micro-batches
        (:meth:`~slm_align.rl.learner.Learner.guarded_update`); its statistics."""
        return self.guarded_update(batch, rows, partial(self.loss, batch, adv))

    def loss(self, batch: Rollout, adv: Advantages, fwd: PolicyForward, whole: Whole) -> tuple[torch.Tensor, dict]:
        """The minibatch's loss on ``fwd``'s rows (a micro-batch of it, the minibatch ``whole``).

        loss = L_clip(rho, A) + value_coef * L_V(V, V_old, R) (+ kl_coef * mean_t k3_t when
        kl_mode is "loss"), over the (b, T) completion tokens, each a token mean over the whole
        minibatch: L_clip the clipped surrogate, clip range [1 - eps, 1 + eps]
        (:func:`clipped_policy_loss`); L_V the clipped value loss (:func:`clipped_value_loss`).
        Schulman et al. 2017, eq. 9 without the entropy bonus.
        """
        s, ppo = self.settings, self.settings.ppo
        rows = fwd.rows
        policy_loss, clip_frac = clipped_policy_loss(fwd.ratio, adv.tokens[rows], fwd.mask, (s.clip_eps, s.clip_eps),
                                                     "token_mean", s.max_new_tokens, fwd.weights, whole)
        value_loss = clipped_value_loss(fwd.values, batch.values[rows], adv.returns[rows], fwd.mask,
                                        ppo.value_clip, whole)
        loss = policy_loss + ppo.value_coef * value_loss
        if ppo.kl_mode == "loss":
            kl = kl_k3(fwd.logprobs, batch.ref_logprobs[rows], self.envelope.log_ratio_clamp)
            loss = loss + self.kl_coef * aggregate(kl, fwd.mask, "token_mean", s.max_new_tokens, whole)
        stats = {"loss/policy": float(policy_loss.detach()), "clip_frac": float(clip_frac),
                 "loss/value": float(value_loss.detach())}
        return loss, stats

    def run_step(self, step: int) -> dict:
        """One PPO iteration: rollout, advantages, guarded updates, the KL controller; metrics."""
        ppo = self.settings.ppo
        started = time.perf_counter()
        self.clock = PhaseClock()
        # --- rollout
        batch = self.rollout(step)
        self.require_training_tokens(batch, step)
        # --- advantages
        adv = self.advantages(batch)
        # --- update: ``epochs`` seeded shuffles of the rollout, a guarded step per minibatch,
        # at the iteration's learning rate (warmup, the watchdog's scale)
        self.set_learning_rate()
        results = [self.minibatch(batch, rows, adv) for rows in self.minibatches(batch, step)]
        self.step = step + 1
        # --- KL controller: beta * (1 + 0.1 * clip(KL / target - 1, -0.2, 0.2)), Ziegler et al.
        kl = rollout_kl(batch)
        if ppo.adaptive_kl:
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl, ppo.target_kl)
        metrics = rollout_metrics(batch, results, kl, time.perf_counter() - started)
        metrics["value/explained_variance"] = explained_variance(adv.returns, batch.values,
                                                                 batch.mask)
        metrics.update(self.run_metrics())
        metrics.update(self.sampler_figures(batch))
        return metrics


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the returns' variance the value head explains: 1 - Var[R - V] / Var[R].

    returns, values, mask: (B, T), over ``mask``. Here Var[R - V] is the mean squared error
    E[(R - V)^2] (not centred) and Var[R] the population variance of R; 1 is a perfect critic, 0
    one no better than the mean return, negative worse. 0.0 when R is constant. As CleanRL's
    ``ppo.py`` and TRL's PPOTrainer log it.
    """
    residual = masked_mean((returns - values) ** 2, mask)
    variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    return float(1 - residual / variance) if variance > 0 else 0.0
