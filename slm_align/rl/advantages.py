"""Whitening, sigma clipping, GAE (PPO) and group-relative advantages (GRPO)."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def sigma_clip(x: torch.Tensor, n_sigma: float, mask: torch.Tensor = None) -> tuple[torch.Tensor, int]:
    """Clip ``x`` to mean +- n_sigma std (over ``mask``); returns the tensor and how many values were clipped."""
    if n_sigma <= 0:
        return x, 0
    mask = torch.ones_like(x) if mask is None else mask
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    low, high = mean - n_sigma * std, mean + n_sigma * std
    clipped = x.clamp(low, high)
    return clipped * mask, int(((x < low) | (x > high)).logical_and(mask > 0).sum())


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over the completion tokens; returns (advantages, returns)."""
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(batch)
    for t in reversed(range(length)):
        next_mask = mask[:, t + 1] if t + 1 < length else torch.zeros(batch)
        next_value = values[:, t + 1] * next_mask if t + 1 < length else torch.zeros(batch)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * next_mask * last
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def group_advantages(scores: torch.Tensor, group_size: int, scale: str, eps: float = 1e-6):
    """(reward - group mean), divided by the group std, the batch std, or nothing; and the zero-std groups."""
    groups = scores.view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    std = groups.std(-1, keepdim=True)
    zero_std = int((std.squeeze(-1) < eps).sum())
    if scale == "group":
        centred = centred / (std + eps)
    elif scale == "batch":
        centred = centred / (scores.std() + eps)
    return centred.view(-1), zero_std
