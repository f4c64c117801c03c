"""The importance ratio in float32 with its log clamped (envelope rules 3 and 9), and the ratio
guard (rule 5): a minibatch whose mean ratio over all ranks exceeds the bound is skipped
entirely (no backward, no step).
"""

from __future__ import annotations

import torch


def ratio_of(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, clamp: float) -> torch.Tensor:
    """Importance ratio rho_t = pi(y_t) / pi_old(y_t) per token.

    Args:
        new_logprobs, old_logprobs: (B, T) log-probabilities of the sampled tokens now and at
        rollout time. clamp: bound of |log-ratio| (the envelope's ``log_ratio_clamp``).

    Returns:
        (B, T) float32 ``exp(clamp(log pi - log pi_old, -clamp, clamp))``: the log-ratio taken in
        float32 and clamped before exp so that it cannot overflow (the envelope's float32 rule; bf16
        log-probabilities are cast first).
    """
    return torch.exp((new_logprobs.float() - old_logprobs.float()).clamp(-clamp, clamp))


def ratio_guard_trips(mean_ratio: float, bound: float) -> bool:
    """Whether the guard skips a minibatch: its world-wide mean ratio exceeds ``bound``
    (0 turns the guard off)."""
    return bool(bound) and mean_ratio > bound
