"""Whitening, sigma clipping, per-token rewards and GAE (PPO), group-relative advantages (GRPO).

Shapes: B sequences (completions), T completion tokens (right-padded); ``mask`` (B, T) is
1 on the completion tokens that train and 0 on padding (and on truncated completions
under ``mask_truncated``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Advantages:
    """An iteration's advantages, what its minibatches' losses read."""

    tokens: torch.Tensor  # (B, T) per-token advantages A_t, zero outside the mask
    returns: Optional[torch.Tensor] = None  # (B, T) PPO: GAE's A_t + V_t, A before whitening


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1: sum(x * m) / max(sum(m), 1).

    Args:
        x, mask: equal shapes, e.g. (B, T). Returns a scalar; 0 when the mask is empty (not NaN).

    As TRL's ``masked_mean`` (without its per-axis option).
    """
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``x`` over the entries where ``mask`` is 1, zero elsewhere.

    Args:
        x, mask: (B, T), e.g. PPO's per-token advantages and the completion mask.

    Returns:
        (B, T) ``(x - mu) / sqrt(var + eps) * m`` with mu = masked_mean(x), var =
        masked_mean((x - mu)^2): the population variance, as TRL's ``masked_whiten`` (which
        follows OpenAI's lm-human-preferences).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def whiten_scores(scores: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """PPO's whitening of the sequence scores across the batch, before the sigma clip.

    Args:
        scores: (B,) one reward per completion.

    Returns:
        (B,) ``(r - mean(r)) / (std(r) + eps)`` with the unbiased (Bessel) std; ``scores`` unchanged
        when B = 1 (no spread to measure). The envelope's reward whitening (the alignment paper's
        "reward normalisation"; TRL's PPOTrainer whitens its scores too).
    """
    if scores.numel() <= 1:
        return scores
    return (scores - scores.mean()) / (scores.std() + eps)


def two_levels(x: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the entries of ``x`` under ``mask`` (equal shapes) take at most two distinct values."""
    return torch.unique(x[mask > 0]).numel() <= 2


def sigma_clip(x: torch.Tensor, n_sigma: float, mask: torch.Tensor = None) -> tuple[torch.Tensor, int]:
    """Clip ``x`` to mean +- n_sigma * std, both taken over ``mask``; returns it and how
    many values were clipped.

    Args:
        x, mask: equal shapes, e.g. (B,) scores or (B, T) advantages; ``mask`` None means all ones.
        n_sigma: the bound in population standard deviations; 0 or less turns the clip off.

    Returns:
        ``clamp(x, mu - n * sigma, mu + n * sigma) * m`` (entries outside ``mask`` come back
        as 0) with mu = masked_mean(x), sigma = sqrt(masked_mean((x - mu)^2)); and the count
        of masked entries outside the bounds. The envelope's 3-sigma clip (the alignment
        paper's reward clipping).

    Values that take at most two levels over ``mask`` (a pass/fail reward) are left alone: a
    success rarer than 10% sits over 3 sigma (z = sqrt((1 - p) / p)), yet it is the signal, not an
    outlier; clipping it would shrink a lone success's advantage under unscaled rewards (Dr. GRPO's
    ``scale_rewards = "none"``: 0.875 -> 0.48 among G = 8) and PPO's score against its KL penalty.
    Off or two-level, ``x`` comes back as given (the object itself) with a count of 0.
    """
    mask = torch.ones_like(x) if mask is None else mask
    if n_sigma <= 0 or two_levels(x, mask):
        return x, 0
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    low = mean - n_sigma * std
    high = mean + n_sigma * std
    clipped = x.clamp(low, high)
    return clipped * mask, int(((x < low) | (x > high)).logical_and(mask > 0).sum())


def per_token_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float) -> torch.Tensor:
    """PPO's per-token rewards (reward shaping): a KL penalty on every completion token,
    the score on the last one.

    Args:
        scores: (B,) sequence-level reward of each completion (whitened and clipped by the
        caller). logprobs, ref_logprobs: (B, T) log-probabilities of the sampled tokens under
        the rollout policy and the
            reference; ``mask``: (B, T) 1 on completion tokens that train
            (right-padded, contiguous).
        kl_coef: weight of the k1 KL penalty (0 when the KL goes into the loss instead).

    Returns:
        (B, T) r_t = -kl_coef * (log pi(y_t) - log pi_ref(y_t)) * m_t, plus ``scores`` at t = L - 1
        with L = sum_t m_t (the last completion token, its EOS when it has one). A row whose mask
        is all zero gets nothing.

    As TRL's ``PPOTrainer`` (non_score_reward = -kl_coef * kl; scores added at the last response
    token) after Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".
    """
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    rows = torch.arange(scores.shape[0], device=scores.device)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards[rows, last] += scores * mask[rows, last]
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over the completion tokens.

    Args:
        rewards, values, mask: (B, T) per-token rewards, the value head's V_t, the completion mask.
        gamma: discount; lam: the GAE lambda (1: Monte Carlo returns, 0: one-step TD).

    Returns:
        advantages and returns, (B, T) each, zero outside ``mask``: delta_t = r_t + gamma * V_{t+1}
        * m_{t+1} - V_t, A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1} (A_T = 0, V_T = 0 past the
        end), returns R_t = A_t + V_t.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", as TRL's PPOTrainer computes it (the value of a padding position never leaks
    into the last real token).
    """
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = rewards.new_zeros(batch)
    for t in reversed(range(length)):
        next_mask = mask[:, t + 1] if t + 1 < length else rewards.new_zeros(batch)
        next_value = values[:, t + 1] * next_mask if t + 1 < length else rewards.new_zeros(batch)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * next_mask * last
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


ZERO_STD = 1e-6  # a group whose rewards spread less than this is "all equal": it carries no GRPO signal


def compact(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's trained positions are, moved to the front in order: ``(index, kept)``,
    (B, S) each, S the most trained positions of a row; ``index`` the positions (0 past a row's
    last, where ``kept`` is 0). An agent episode's mask has gaps (the runtime's inserted tokens);
    a single completion's is already a prefix, so compacting it changes nothing."""
    counts = mask.sum(-1).long()
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    order = torch.argsort((mask <= 0).to(torch.int8), dim=-1, stable=True)[:, :width]
    kept = (torch.arange(width, device=mask.device).unsqueeze(0) < counts.unsqueeze(-1)).to(mask.dtype)
    return order * kept.long(), kept


def gae_over_trained(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     values: torch.Tensor, mask: torch.Tensor, kl_coef: float, gamma: float, lam: float):
    """PPO's per-token rewards and GAE over each row's trained positions only, as if they were
    contiguous: an episode's inserted tokens (tool results, template text) are not steps of the
    policy, so the value of the next sampled token, past them, is what each step bootstraps from.

    scores (B,); logprobs, ref_logprobs, values, mask (B, T). Returns advantages and returns (B, T),
    zero off the mask: the positions are gathered (:func:`compact`), :func:`per_token_rewards` and
    :func:`gae` run on the compact (B, S) tensors, and the results go back to their positions.
    """
    index, kept = compact(mask)

    def gathered(x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, index) * kept

    rewards = per_token_rewards(scores, gathered(logprobs), gathered(ref_logprobs), kept, kl_coef)
    advantages, returns = gae(rewards, gathered(values), kept, gamma, lam)
    spread = torch.zeros_like(mask)
    return spread.scatter_add(1, index, advantages * kept), spread.scatter_add(1, index, returns * kept)


def all_equal_groups(scores: torch.Tensor, group_size: int) -> list[int]:
    """The groups whose rewards are all equal (unbiased std below ``ZERO_STD``): no GRPO signal.

    Args:
        scores: (B,) one reward per completion, B = groups * ``group_size``, each group contiguous.

    Returns:
        Indices g (0-based, in order) of those groups;
        :func:`group_advantages` counts the same groups.
    """
    std = scores.view(-1, group_size).std(-1)
    return [int(g) for g in (std < ZERO_STD).nonzero().flatten()]


def group_advantages(scores: torch.Tensor, group_size: int, scale: str, eps: float = 1e-4):
    """GRPO's group-relative advantages; returns them and the number of all-equal groups.

    Args:
        scores: (B,) one reward per completion, B = groups * ``group_size``, each group
        contiguous. scale: "group": A_i = (r_i - mean_g) / (std_g + eps); "batch": the
        batch std instead of std_g
            (Dr. GRPO's suggestion, Liu et al. 2025); "none": A_i = r_i - mean_g.

    Returns:
        (B,) advantages, each group summing to zero; and how many groups have std_g < ``ZERO_STD``.

    std is the unbiased (Bessel) std and ``eps`` = 1e-4 is added to it, as TRL's ``GRPOTrainer``
    does (Shao et al. 2024, DeepSeekMath, eq. for outcome supervision).
    """
    groups = scores.view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    std = groups.std(-1, keepdim=True)
    zero_std = int((std.squeeze(-1) < ZERO_STD).sum())
    if scale == "group":
        centred = centred / (std + eps)
    elif scale == "batch":
        centred = centred / (scores.std() + eps)
    return centred.view(-1), zero_std


def grpo_advantages(scores: torch.Tensor, group_size: int, scale: str, n_sigma: float) -> tuple[torch.Tensor, int]:
    """GRPO's advantages inside the envelope: sigma-clip the raw scores over the batch,
    then normalise in groups.

    Args:
        scores: (B,) raw rewards, groups of ``group_size`` contiguous; ``scale``: see
        :func:`group_advantages`; n_sigma: the envelope's clip (0: off).

    Returns:
        (B,) advantages group_advantages(sigma_clip(r, n_sigma)) and how many
        raw scores the clip moved.

    Clipping before the group normalisation, as the alignment paper's code does, keeps every
    group's sum at zero; a batch-wide sigma taken over group advantages (zeros of all-equal groups
    included) would cut a lone success among G=16 (its advantage (G-1)/sqrt(G) = 3.75 is over 3
    sigma) and break that sum.
    """
    clipped, count = sigma_clip(scores, n_sigma)
    advantages, _ = group_advantages(clipped, group_size, scale)
    return advantages, count
