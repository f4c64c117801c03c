"""The DPO and KTO losses on summed completion log-probabilities (all float32).

Notation: for a completion y of prompt x, ``logp = log pi(y|x)`` under the policy and ``ref = log
pi_ref(y|x)`` under the reference (the SFT prior), both summed over the completion's tokens. The
implicit reward of the completion is ``r = beta * (logp - ref)`` (Rafailov et al. 2023, section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossTerms:
    """A loss and what it was made of: per-item losses and implicit rewards, shapes (B,)."""

    loss: torch.Tensor
    losses: torch.Tensor
    rewards: torch.Tensor


def implicit_rewards(logp: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """r = beta * (logp - ref), shape (B,) from two (B,) tensors."""
    return beta * (logp.float() - ref.float())


def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, chosen_ref: torch.Tensor,
             rejected_ref: torch.Tensor, beta: float) -> LossTerms:
    """DPO's sigmoid loss, mean over the batch.

    Inputs (B,) each. With r_c, r_r the implicit rewards of chosen and rejected, loss_i = -log
    sigmoid(r_c,i - r_r,i) (Rafailov et al. 2023, eq. 7; TRL DPOTrainer, loss_type="sigmoid").
    ``rewards`` holds the margins r_c - r_r, shape (B,).
    """
    margins = implicit_rewards(chosen_logp, chosen_ref, beta) - implicit_rewards(rejected_logp, rejected_ref, beta)
    losses = -F.logsigmoid(margins)
    return LossTerms(losses.mean(), losses, margins)


def kto_reference_point(kl_logp: torch.Tensor, kl_ref: torch.Tensor) -> torch.Tensor:
    """z_ref = max(0, mean_j (log pi(y_j'|x_j) - log pi_ref(y_j'|x_j))), detached, a scalar.

    (B,) inputs on mismatched pairs (prompt j with another item's completion), the KL estimate of
    the KTO paper (Ethayarajh et al. 2024, eq. 8; TRL KTOTrainer computes it the same way, clamped
    at 0 and without gradient).
    """
    return (kl_logp.float() - kl_ref.float()).mean().clamp(min=0).detach()


def kto_loss(logp: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, z_ref: torch.Tensor, beta: float,
             desirable_weight: float, undesirable_weight: float) -> LossTerms:
    """KTO's loss, mean over the batch.

    logp, ref: (B,); desirable: (B,) bool; z_ref: scalar from :func:`kto_reference_point`.
    With r the implicit reward (un-scaled log-ratio rho = logp - ref, r = beta * rho):
    desirable: lambda_D * (1 - sigmoid(beta * (rho - z_ref))); undesirable: lambda_U * (1 -
    sigmoid(beta * (z_ref - rho))) (Ethayarajh et al. 2024, eq. 8; TRL KTOTrainer's kto_loss).
    ``rewards`` holds r, shape (B,).
    """
    rho = logp.float() - ref.float()
    good = desirable_weight * (1 - torch.sigmoid(beta * (rho - z_ref)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z_ref - rho)))
    losses = torch.where(desirable, good, bad)
    return LossTerms(losses.mean(), losses, beta * rho)
