"""Losses, KL estimators and explained variance on hand-computed inputs, and what PPO's and GRPO's
minibatch adds up: each test fails on a flipped sign, a wrong normaliser or a misplaced index."""

import math
from types import SimpleNamespace

import pytest
import torch

from slm_align.config import EnvelopeSettings, GRPOSettings, PPOSettings, RLSettings
from slm_align.envelope.ratio import ratio_of
from slm_align.envelope.world import World
from slm_align.rl.advantages import Advantages, masked_mean
from slm_align.rl.grpo import GRPO, zero_std_share
from slm_align.rl.learner import PolicyForward
from slm_align.rl.losses import (
    Whole,
    adaptive_kl_coef,
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    kl_k1,
    kl_k3,
)
from slm_align.rl.ppo import PPO, explained_variance


def test_loss_normalisations():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", 4).item() == pytest.approx(8 / 5)
    assert aggregate(per_token, mask, "grpo", 4).item() == pytest.approx((1 + 4) / 2)
    assert aggregate(per_token, mask, "dr_grpo", 4).item() == pytest.approx(8 / (2 * 4))


def test_clipped_policy_loss_is_pessimistic_and_asymmetric():
    mask = torch.ones(1, 2)
    ratio = torch.tensor([[1.5, 0.5]])
    loss, clip_frac = clipped_policy_loss(ratio, torch.tensor([[1.0, 1.0]]), mask, (0.2, 0.28), "token_mean", 2)
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2) and clip_frac.item() == 0.5
    loss, _ = clipped_policy_loss(ratio, torch.tensor([[-1.0, -1.0]]), mask, (0.2, 0.28), "token_mean", 2)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_value_loss_clips_the_update():
    values, old, returns, mask = torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[3.0]]), torch.ones(1, 1)
    assert clipped_value_loss(values, old, returns, mask, clip=0.5).item() == pytest.approx(0.5 * (3.0 - 0.5) ** 2)


def test_kl_estimators_and_the_fp32_ratio_clamp():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_k1(logp, ref).tolist() == pytest.approx([0.5, -1.0])
    k3 = kl_k3(logp, ref)
    assert (k3 >= 0).all() and k3[0].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    huge = ratio_of(torch.tensor([200.0]).bfloat16(), torch.tensor([0.0]), clamp=20.0)
    assert huge.dtype == torch.float32 and huge.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_k3_log_ratio_is_clamped_like_the_policy_ratio():
    far = kl_k3(torch.tensor([-100.0]), torch.tensor([0.0]))  # the reference finds the token e^100 times likelier
    assert torch.isfinite(far).all() and far.item() == pytest.approx(math.exp(20.0) - 1 - 20.0, rel=1e-6)
    assert kl_k3(torch.tensor([-100.0]), torch.tensor([0.0]), clamp=5.0).item() == pytest.approx(math.exp(5) - 6)
    assert kl_k3(torch.tensor([-1.0]).bfloat16(), torch.tensor([-1.0])).dtype == torch.float32


def test_adaptive_kl_error_is_clipped_at_two_tenths():
    assert adaptive_kl_coef(0.05, kl=10.0, target=0.1) == pytest.approx(0.05 * 1.02)  # not 0.05 * 1.1
    assert adaptive_kl_coef(0.05, kl=0.0, target=0.1) == pytest.approx(0.05 * 0.98)
    assert adaptive_kl_coef(0.05, kl=0.11, target=0.1) == pytest.approx(0.05 * (1 + 0.1 * 0.1))


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert explained_variance(returns, values, mask) == pytest.approx(1 - (1 / 3) / (2 / 3))  # 0.5
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3)) == 0.0  # constant returns


def fake_run(**settings):
    """What an algorithm's ``loss`` reads from its run: settings, the envelope, PPO's KL
    coefficient and the token budget of a single-turn row (``max_new_tokens``)."""
    rl = RLSettings(max_new_tokens=2, **settings)
    return SimpleNamespace(settings=rl, envelope=EnvelopeSettings(), kl_coef=0.3,
                           token_budget=lambda: rl.max_new_tokens)


def minibatch_loss(algorithm, run, batch, forward: PolicyForward, advantages: Advantages):
    """``algorithm``'s loss on a :func:`fake_run` for ``forward``'s rows as a whole minibatch, and
    its statistics."""
    return algorithm.loss(run, batch, advantages, forward, Whole.of(forward.mask))


def loss_inputs():
    rows = torch.tensor([0])
    new = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0]])
    ratio = torch.tensor([[1.0, 1.0]])
    batch = SimpleNamespace(values=torch.tensor([[0.0, 0.0]]), ref_logprobs=ref)
    return rows, new, ref, mask, ratio, batch


@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_ppo_loss_adds_the_weighted_value_loss_and_k3_only_in_loss_mode(kl_mode):
    rows, new, ref, mask, ratio, batch = loss_inputs()
    advantages = torch.tensor([[1.0, -1.0]])
    returns = torch.tensor([[2.0, 0.0]])
    forward = PolicyForward(rows, new, torch.tensor([[0.0, 0.0]]), ratio, mask, {})
    run = fake_run(ppo=PPOSettings(value_coef=0.25, kl_mode=kl_mode))
    loss, stats = minibatch_loss(PPO, run, batch, forward, Advantages(advantages, returns))
    policy = 0.0  # ratio 1: -(1 * 1 + (-1) * 1) / 2
    value = 0.5 * (4.0 + 0.0) / 2  # V = V_old = 0, R = (2, 0)
    k3 = masked_mean(kl_k3(new, ref), mask).item() if kl_mode == "loss" else 0.0
    assert stats["loss/policy"] == pytest.approx(policy) and stats["loss/value"] == pytest.approx(value)
    assert loss.item() == pytest.approx(policy + 0.25 * value + 0.3 * k3)


def test_grpo_loss_adds_beta_times_the_k3_kl_with_the_same_normalisation():
    rows, new, ref, mask, ratio, batch = loss_inputs()
    mask = torch.tensor([[1.0, 0.0]])  # one token trains: dr_grpo divides by B * max_new_tokens = 2
    advantages = torch.tensor([[2.0, 5.0]])
    forward = PolicyForward(rows, new, None, ratio, mask, {})
    run = fake_run(grpo=GRPOSettings(beta=0.5, loss_type="dr_grpo"))
    loss, stats = minibatch_loss(GRPO, run, batch, forward, Advantages(advantages))
    k3 = math.exp(-0.5) - 1 + 0.5  # d = log pi_ref - log pi = -0.5 on the token that trains
    assert stats["loss/policy"] == pytest.approx(-2.0 / 2)
    assert loss.item() == pytest.approx(-2.0 / 2 + 0.5 * k3 / 2)


class TwoRanks:
    """A world of 2 ranks whose other rank counted ``other`` (the all-reduce done by hand)."""

    size = 2

    def __init__(self, other: float):
        self.other = other

    def mean(self, value: float) -> float:
        return (value + self.other) / 2


def test_the_share_of_all_equal_groups_counts_every_ranks_groups():
    assert zero_std_share(2, 4, World()) == 0.5  # one process: 2 of its 4 groups
    assert zero_std_share(2, 4, TwoRanks(other=1.0)) == 1.0  # 2 ranks x 2 prompts, every group all-equal
    assert zero_std_share(0, 4, TwoRanks(other=0.5)) == 0.25  # 1 of the 4 groups, on the other rank
