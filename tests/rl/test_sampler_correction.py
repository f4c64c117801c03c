"""The correction for rollouts another engine sampled: truncated importance weights and the mismatch
figures, against hand-computed values and a Monte Carlo KL."""

import math

import pytest
import torch

from slm_align.rl.losses import clipped_policy_loss
from slm_align.rl.sampler_correction import sampler_mismatch, sampler_weights

TRAIN = torch.tensor([[-1.0, -2.0, -3.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -9.0]])  # the third token is padding: its difference must not count
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_token_weights_are_the_trainers_over_the_samplers_probability_capped_or_masked():
    truncated = sampler_weights(TRAIN, SAMPLER, MASK, cap=1.5, mode="token_truncate")
    assert truncated[0, :2].tolist() == pytest.approx([1.5, math.exp(-1.0)])  # e^0.5 = 1.65 capped; e^-1 kept
    assert truncated[0, 2].item() == 1.0  # off the mask: no correction
    masked = sampler_weights(TRAIN, SAMPLER, MASK, cap=1.5, mode="token_mask")
    assert masked[0, :2].tolist() == pytest.approx([0.0, math.exp(-1.0)])  # over the cap: the token does not train


def test_sequence_weights_sum_the_log_ratios_of_the_completions_tokens():
    weight = sampler_weights(TRAIN, SAMPLER, MASK, cap=2.0, mode="sequence_truncate")
    assert weight.shape == (1, 1) and weight.item() == pytest.approx(math.exp(0.5 - 1.0))
    more = torch.tensor([[-1.0, -1.0, -3.0]])  # log-ratios 0.5 and 0: e^0.5 = 1.65
    assert sampler_weights(more, SAMPLER, MASK, cap=1.5, mode="sequence_truncate").item() == 1.5
    assert sampler_weights(more, SAMPLER, MASK, cap=1.5, mode="sequence_mask").item() == 0.0


def test_equal_engines_change_nothing():
    weights = sampler_weights(TRAIN, TRAIN, MASK, cap=2.0, mode="token_truncate")
    assert torch.equal(weights, torch.ones_like(TRAIN))
    figures = sampler_mismatch(TRAIN, TRAIN, MASK, cap=2.0, mode="token_truncate")
    assert figures == {"sampler/kl": 0.0, "sampler/max_log_ratio": 0.0, "sampler/capped_frac": 0.0}


def test_mismatch_figures_on_hand_computed_values():
    figures = sampler_mismatch(TRAIN, SAMPLER, MASK, cap=1.5, mode="token_truncate")
    k3 = [math.expm1(0.5) - 0.5, math.expm1(-1.0) + 1.0]  # (w - 1) - log w
    assert figures["sampler/kl"] == pytest.approx(sum(k3) / 2)
    assert figures["sampler/max_log_ratio"] == pytest.approx(1.0)  # |-1|, not the padding's 6
    assert figures["sampler/capped_frac"] == pytest.approx(0.5)
    sequence = sampler_mismatch(TRAIN, SAMPLER, MASK, cap=1.5, mode="sequence_truncate")
    assert sequence["sampler/capped_frac"] == 0.0  # the completion's weight e^-0.5 is under the cap


def test_the_kl_estimate_is_kl_of_the_sampler_from_the_trainer():
    """Tokens drawn from the sampler q: the mean of k3 converges to KL(q || p), not KL(p || q)."""
    q = torch.tensor([0.98, 0.01, 0.01])
    p = torch.tensor([0.5, 0.25, 0.25])
    draws = torch.multinomial(q, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    train = p.log()[draws].unsqueeze(0)
    sampler = q.log()[draws].unsqueeze(0)
    estimate = sampler_mismatch(train, sampler, torch.ones_like(train), cap=2.0, mode="token_truncate")["sampler/kl"]
    forward = float((q * (q / p).log()).sum())  # 0.595
    reverse = float((p * (p / q).log()).sum())  # 1.273
    assert abs(forward - reverse) > 0.5
    assert estimate == pytest.approx(forward, rel=0.05)


def test_the_policy_loss_weighs_each_tokens_term():
    ratio = torch.ones(1, 3)
    advantages = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    plain, _ = clipped_policy_loss(ratio, advantages, mask, (0.2, 0.2), "token_mean", 3)
    weights = torch.tensor([[0.5, 2.0, 7.0]])
    weighted, _ = clipped_policy_loss(ratio, advantages, mask, (0.2, 0.2), "token_mean", 3, weights)
    assert plain.item() == pytest.approx(-2.0)
    assert weighted.item() == pytest.approx(-(2.0 * 0.5 + 2.0 * 2.0) / 2)  # the padding's 7 takes no part
