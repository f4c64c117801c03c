"""The importance ratio, the clipped policy loss with three normalisations, the clipped value loss,
KL estimators and the adaptive KL controller.

Shapes: B sequences, T completion tokens; ``mask`` (B, T) is 1 on the completion tokens that train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from slm_align.rl.advantages import masked_mean


@dataclass(frozen=True)
class Whole:
    """The minibatch a loss is normalised over: its rows (sequences) and the completion tokens
    that train in it. A micro-batch's loss divided by its minibatch's whole, summed over the
    micro-batches, is the minibatch's loss (gradient accumulation without a per-micro-batch
    normaliser, which would weigh a short micro-batch's tokens more)."""

    rows: int
    tokens: float

    @classmethod
    def of(cls, mask: torch.Tensor) -> "Whole":
        """The whole of a (B, T) completion mask."""
        return cls(mask.shape[0], float(mask.sum()))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_tokens: int,
              whole: Optional[Whole] = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar, three ways.

    Args:
        per_token, mask: (b, T), b rows of a minibatch of B rows. max_tokens: the completion
            budget L_max (``max_new_tokens``). whole: the minibatch's B and sum(m) (None: these b
            rows are the whole minibatch). loss_type:
            "token_mean": sum(l * m) / sum_minibatch(m), every token of the minibatch weighs the
            same (DAPO, Yu et al. 2025; TRL's "bnpo");
            "grpo": sum over sequences of (sum_t(l * m) / sum_t(m)) / B, each sequence weighs the
            same (Shao et al. 2024);
            "dr_grpo": sum(l * m) / (B * L_max), a constant normaliser with no length bias (Liu et
            al. 2025, "Understanding R1-Zero-Like Training").

    Returns:
        A scalar; summed over a minibatch's micro-batches (each with the minibatch's ``whole``),
        the minibatch's. As TRL's GRPOTrainer ``loss_type`` options.
    """
    whole = whole or Whole.of(mask)
    if loss_type == "token_mean":
        return (per_token * mask).sum() / max(whole.tokens, 1.0)
    if loss_type == "grpo":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence.sum() / whole.rows
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (whole.rows * max_tokens)
    raise ValueError(f"unknown loss type {loss_type}")


def clipped_policy_loss(ratio, advantages, mask, clip: tuple[float, float], loss_type: str, max_tokens: int,
                        weights=None, whole: Optional[Whole] = None):
    """PPO's pessimistic clipped surrogate.

    Args:
        ratio, advantages, mask: (B, T) importance ratios rho_t, advantages A_t, the
        completion mask. clip: (eps_low, eps_high), the clip range [1 - eps_low, 1 + eps_high] (equal
        for PPO; GRPO's upper bound is
            DAPO's "clip-higher", Yu et al. 2025). loss_type, max_tokens: see :func:`aggregate`.
        weights: None, or (B, T) / (B, 1) weights without gradient multiplying each token's term: the
            sampler correction of rollouts another engine drew
            (:func:`~slm_align.rl.sampler_correction.sampler_weights`).
        whole: the minibatch these rows belong to (see :func:`aggregate`; None: all of it).

    Returns:
        loss: scalar, ``aggregate(max(-A_t * rho_t, -A_t * clip(rho_t, 1 - eps_low, 1 +
        eps_high)))``; clip_frac: scalar, the masked share of these rows' tokens where the clipped
        term is the larger (the clip is active).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (negated: a loss to
    minimise), as torchtune's ``PPOLoss`` and TRL's trainers write it.
    """
    eps_low, eps_high = clip
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, mask, loss_type, max_tokens, whole)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clip_frac


def clipped_value_loss(values, old_values, returns, mask, clip: float,
                       whole: Optional[Whole] = None) -> torch.Tensor:
    """PPO's clipped value loss.

    Args:
        values, old_values, returns, mask: (b, T) the value head's V now, V_old at
        rollout time, GAE's returns R,
            the completion mask. clip: how far V may move from V_old before
            the clipped term takes over. whole: the minibatch these rows belong to (None: all).

    Returns:
        Scalar 0.5 * masked_mean(max((V - R)^2, (V_clip - R)^2)) over the minibatch's tokens,
        V_clip = V_old + clip(V - V_old, -clip, clip).

    As TRL's PPOTrainer and torchtune's ``PPOLoss`` (after OpenAI's baselines ppo2).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    squared = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * aggregate(squared, mask, "token_mean", 1, whole)


def kl_k1(logprobs, ref_logprobs):
    """Schulman's k1 estimator of KL(pi || pi_ref) per token.

    Args:
        logprobs, ref_logprobs: (B, T) log-probabilities of the sampled tokens (sampled from pi).

    Returns:
        (B, T) k1 = log pi(y) - log pi_ref(y): unbiased, can be negative per token (J. Schulman,
        "Approximating KL divergence", 2020). PPO's KL penalty in the reward
        (:func:`per_token_rewards`) is -kl_coef * k1.
    """
    return logprobs - ref_logprobs


def kl_k3(logprobs, ref_logprobs, clamp: float = 20.0):
    """Schulman's k3 estimator of KL(pi || pi_ref) per token.

    Args:
        logprobs, ref_logprobs: (B, T) log-probabilities of the sampled tokens (sampled from pi).
        clamp: bound of |d| before exp.

    Returns:
        (B, T) float32 k3 = exp(d) - 1 - d with d = clamp(log pi_ref(y) - log pi(y), -clamp,
        clamp): unbiased, non-negative, lower variance than k1 (J. Schulman, "Approximating KL
        divergence", 2020; the GRPO loss, Shao et al. 2024, and TRL's GRPOTrainer). d is taken in
        float32 and clamped as the policy ratio is, so that a token the reference finds far
        likelier cannot overflow to inf.
    """
    log_ratio = (ref_logprobs.float() - logprobs.float()).clamp(-clamp, clamp)
    return torch.exp(log_ratio) - 1 - log_ratio


def adaptive_kl_coef(coef: float, kl: float, target: float, gain: float = 0.1) -> float:
    """The adaptive KL controller's next coefficient.

    Args:
        coef: the current coefficient beta. kl: the rollout's mean KL per sequence (sum over tokens
        of k1). target: the KL per sequence aimed for. gain: K_beta, the proportional gain.

    Returns:
        beta * (1 + gain * e) with e = clip(kl / target - 1, -0.2, 0.2): the error is clipped so
        that one odd rollout moves the coefficient by at most 2% (Ziegler et al. 2019, section 2.2,
        with one update per iteration; TRL's ``AdaptiveKLController`` scales the step by the
        batch's share of its horizon).
    """
    error = max(-0.2, min(0.2, kl / target - 1))
    return coef * (1 + gain * error)
