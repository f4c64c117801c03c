"""The correction for rollouts that another engine sampled (llama.cpp from quantized or F16 weights)
than the one that trains (PyTorch in fp32): truncated importance weights on the policy-gradient terms,
and the figures that say how far the two engines disagree.

The trainer's own old/new ratio stays trainer against trainer (its first value is still exactly 1);
this weight multiplies each token's clipped surrogate by how much likelier the trainer finds the
sampled token than the sampler did, capped so that a token the sampler drew against the odds does not
dominate. Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
(truncated importance sampling); TRL's ``vllm_importance_sampling_correction`` offers the same four
modes.

Shapes: B sequences, T completion tokens; ``mask`` (B, T) is 1 on the completion tokens that train.
"""

from __future__ import annotations

import torch

from slm_align.rl.advantages import masked_mean

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""token_*: one weight per token; sequence_*: one per completion, from the sum of its tokens' log-ratios;
*_truncate: weights above the cap become the cap; *_mask: weights above the cap become 0 (the token or
completion does not train)."""


def log_ratios(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
               mode: str) -> torch.Tensor:
    """log w = log pi_train(y_t) - log pi_sampler(y_t) on the mask, 0 off it: (B, T) for token modes,
    (B, 1) summed over each completion's tokens for sequence modes.

    A sampler log-probability that is not finite (an engine that could not score a token) gives 0: no
    correction for that token, as TRL does for vLLM's missing scores."""
    difference = (train_logprobs.float() - sampler_logprobs.float()) * mask
    difference = torch.nan_to_num(difference, nan=0.0, posinf=0.0, neginf=0.0)
    if mode.startswith("sequence"):
        return difference.sum(-1, keepdim=True)
    return difference


def sampler_weights(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                    cap: float, mode: str) -> torch.Tensor:
    """The truncated importance weights, without gradient.

    Args:
        train_logprobs, sampler_logprobs, mask: (B, T): the trainer's log-probabilities of the sampled
            tokens under the rollout's policy (the old pass's), the sampler's own, the completion mask.
        cap: C > 0. mode: one of :data:`MODES`.

    Returns:
        (B, T) for token modes or (B, 1) for sequence modes: w = exp(log_ratios), then min(w, C)
        (truncate) or w * [w <= C] (mask).
    """
    if mode not in MODES:
        raise ValueError(f"unknown sampler correction mode {mode}")
    weights = torch.exp(log_ratios(train_logprobs, sampler_logprobs, mask, mode).detach())
    if mode.endswith("truncate"):
        return weights.clamp(max=cap)
    return weights.masked_fill(weights > cap, 0.0)


def sampler_mismatch(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                     cap: float, mode: str) -> dict[str, float]:
    """How far sampler and trainer disagree on one rollout.

    ``sampler/kl``: KL(sampler || trainer) per token, k3-estimated on tokens the sampler drew:
    mean of (w - 1) - log w with w = pi_train / pi_sampler (unbiased and never negative; Schulman 2020,
    "Approximating KL divergence"); ``sampler/max_log_ratio``: max |log w| over the tokens;
    ``sampler/capped_frac``: the share of weights (tokens or completions, as the mode weighs) over the cap.
    """
    per_token = log_ratios(train_logprobs, sampler_logprobs, mask, "token_truncate").detach()
    k3 = torch.expm1(per_token) - per_token
    weighed = log_ratios(train_logprobs, sampler_logprobs, mask, mode).detach()
    if mode.startswith("sequence"):
        counted = (mask.sum(-1, keepdim=True) > 0).float()
    else:
        counted = mask
    over = (torch.exp(weighed) > cap).float()
    return {"sampler/kl": float(masked_mean(k3, mask)),
            "sampler/max_log_ratio": float((per_token.abs() * mask).max()) if mask.numel() else 0.0,
            "sampler/capped_frac": float(masked_mean(over, counted))}
