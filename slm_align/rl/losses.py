"""Clipped policy loss with three normalisations, clipped value loss, and KL estimators."""

from __future__ import annotations

import torch

from slm_align.rl.advantages import masked_mean


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_tokens: int) -> torch.Tensor:
    """token_mean: over all tokens; grpo: per sequence, then over sequences; dr_grpo: by a constant."""
    if loss_type == "token_mean":
        return masked_mean(per_token, mask)
    if loss_type == "grpo":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence.mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * max_tokens)
    raise ValueError(f"unknown loss type {loss_type}")


def ratio_of(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, clamp: float) -> torch.Tensor:
    """Importance ratio pi / pi_old per token, (B, T): exp of the float32 log-ratio, clamped to [-clamp, clamp]
    before exp so that it cannot overflow (the envelope's float32 rule)."""
    return torch.exp((new_logprobs.float() - old_logprobs.float()).clamp(-clamp, clamp))


def clipped_policy_loss(ratio, advantages, mask, eps_low: float, eps_high: float, loss_type: str,
                        max_tokens: int):
    """PPO's pessimistic clipped surrogate; returns (loss, fraction of tokens where the clip was active).

    ratio, advantages, mask: (B, T). loss_t = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - eps_low, 1 + eps_high)),
    aggregated by ``loss_type`` (Schulman et al. 2017; the asymmetric clip is DAPO's "clip-higher", Yu et al. 2025).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, loss_type, max_tokens)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clip_frac


def clipped_value_loss(values, old_values, returns, mask, clip: float) -> torch.Tensor:
    """PPO's clipped value loss, all inputs (B, T): 0.5 * mean over ``mask`` of max((V - R)^2, (V_clip - R)^2),
    V_clip = V_old + clip(V - V_old, -clip, clip) (as TRL's PPOTrainer, after OpenAI's baselines)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def kl_k1(logprobs, ref_logprobs):
    """k1 = log pi(y) - log pi_ref(y) per token, (B, T): unbiased, can be negative (Schulman 2020)."""
    return logprobs - ref_logprobs


def kl_k3(logprobs, ref_logprobs, clamp: float = 20.0):
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: (B, T) log-probabilities in, (B, T) out.

    k3 = exp(d) - 1 - d with d = log pi_ref(y) - log pi(y): unbiased, non-negative, lower variance than k1
    (J. Schulman, "Approximating KL divergence", 2020; the GRPO loss, Shao et al. 2024, and TRL's GRPOTrainer).
    d is taken in float32 and clamped to [-clamp, clamp] before exp, as the policy ratio is, so that a token the
    reference finds far likelier cannot overflow to inf.
    """
    log_ratio = (ref_logprobs.float() - logprobs.float()).clamp(-clamp, clamp)
    return torch.exp(log_ratio) - 1 - log_ratio


def adaptive_kl_coef(coef: float, kl: float, target: float, gain: float = 0.1) -> float:
    """The adaptive KL controller's next coefficient: coef * (1 + gain * e), e = clip(kl / target - 1, -0.2, 0.2).

    ``kl``: the rollout's mean KL per sequence. The proportional error is clipped at +-0.2 so that one odd rollout
    moves the coefficient by at most 2% (Ziegler et al. 2019, section 2.2; TRL's ``AdaptiveKLController``).
    """
    error = max(-0.2, min(0.2, kl / target - 1))
    return coef * (1 + gain * error)
