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
    """exp of the fp32 log-ratio, clamped before exp so that it cannot overflow."""
    return torch.exp((new_logprobs.float() - old_logprobs.float()).clamp(-clamp, clamp))


def clipped_policy_loss(ratio, advantages, mask, eps_low: float, eps_high: float, loss_type: str,
                        max_tokens: int):
    """PPO's pessimistic clipped surrogate; returns (loss, fraction of tokens where the clip was active)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, loss_type, max_tokens)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clip_frac


def clipped_value_loss(values, old_values, returns, mask, clip: float) -> torch.Tensor:
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def kl_k1(logprobs, ref_logprobs):
    """log(p/q): unbiased, can be negative."""
    return logprobs - ref_logprobs


def kl_k3(logprobs, ref_logprobs):
    """(q/p) - 1 - log(q/p): unbiased, non-negative, lower variance."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - 1 - log_ratio
