"""Advantages, losses, KL estimators, metrics and seeds on hand-computed inputs: each test fails on a flipped sign,
a wrong normaliser or a misplaced index."""

import math
from types import SimpleNamespace

import pytest
import torch

from slm_align.config import EnvelopeSettings, GRPOSettings, PPOSettings, RLSettings
from slm_align.envelope.ratio import ratio_of
from slm_align.envelope.seeds import SEED_STREAMS, derive_seed
from slm_align.rl.advantages import (
    Advantages,
    all_equal_groups,
    gae,
    group_advantages,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    per_token_rewards,
    sigma_clip,
    whiten_scores,
)
from slm_align.rl.grpo import GRPO
from slm_align.rl.learner import PolicyForward
from slm_align.rl.losses import adaptive_kl_coef, aggregate, clipped_policy_loss, clipped_value_loss, kl_k1, kl_k3
from slm_align.rl.phases import PhaseClock
from slm_align.rl.ppo import PPO, explained_variance
from slm_align.rl.schedule import iteration_size


def test_gae_matches_the_recursion_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding: its value must not leak in
    gamma = 0.9
    lam = 0.8
    d2 = 1.0 - 0.3
    d1 = 0.0 + gamma * 0.3 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    assert advantages[0].tolist() == pytest.approx([a0, a1, a2, 0.0])
    assert returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.4, a2 + 0.3, 0.0])


def test_group_advantages_and_zero_std_groups():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 5.0])
    adv, zero = group_advantages(scores, group_size=2, scale="none")
    assert adv.tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0] and zero == 2
    adv, _ = group_advantages(scores, group_size=2, scale="group")
    assert adv[:2].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-4)
    assert adv[2:].tolist() == [0.0] * 4
    adv, _ = group_advantages(scores, group_size=2, scale="batch")
    assert adv[1].item() == pytest.approx(1.0 / scores.std().item(), rel=1e-4)
    g = 8  # group-normalised advantages are bounded by (G-1)/sqrt(G)
    one_high = torch.tensor([1.0] + [0.0] * (g - 1))
    assert group_advantages(one_high, g, "group")[0].max().item() <= (g - 1) / math.sqrt(g) + 1e-4


def test_sigma_clip_and_whiten():
    x = torch.tensor([0.0] * 99 + [100.0])
    clipped, count = sigma_clip(x, 3.0)
    mean, std = x.mean(), x.std(unbiased=False)
    assert count == 1 and clipped.max().item() == pytest.approx((mean + 3 * std).item())
    assert sigma_clip(x, 0.0) == (x, 0)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    white = masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), mask)
    assert white[:3].mean().item() == pytest.approx(0.0, abs=1e-6) and white[3].item() == 0.0


def test_loss_normalisations():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", 4).item() == pytest.approx(8 / 5)
    assert aggregate(per_token, mask, "grpo", 4).item() == pytest.approx((1 + 4) / 2)
    assert aggregate(per_token, mask, "dr_grpo", 4).item() == pytest.approx(8 / (2 * 4))


def test_clipped_policy_loss_is_pessimistic_and_asymmetric():
    mask = torch.ones(1, 2)
    ratio = torch.tensor([[1.5, 0.5]])
    loss, clip_frac = clipped_policy_loss(ratio, torch.tensor([[1.0, 1.0]]), mask, 0.2, 0.28, "token_mean", 2)
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2) and clip_frac.item() == 0.5
    loss, _ = clipped_policy_loss(ratio, torch.tensor([[-1.0, -1.0]]), mask, 0.2, 0.28, "token_mean", 2)
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


def test_group_std_epsilon_is_trls():
    adv, _ = group_advantages(torch.tensor([0.0, 1e-3]), group_size=2, scale="group")
    std = math.sqrt(2) * 5e-4  # unbiased std of (0, 0.001)
    assert adv.tolist() == pytest.approx([-5e-4 / (std + 1e-4), 5e-4 / (std + 1e-4)], rel=1e-5)  # not +-0.707


def test_grpo_clips_raw_scores_so_a_lone_success_among_sixteen_keeps_its_advantage():
    g = 16
    scores = torch.zeros(4 * g)
    scores[3] = 1.0  # one success in the first group; three all-equal groups
    adv, clipped = grpo_advantages(scores, g, "group", n_sigma=3.0)
    group = adv[:g]
    assert group[3].item() == pytest.approx((g - 1) / math.sqrt(g), abs=0.01)  # 3.75 (less eps): not cut to 1.45
    assert group.sum().item() == pytest.approx(0.0, abs=1e-5) and (adv[g:] == 0).all()
    assert clipped == 1  # the raw 1 is over 3 sigma of the batch, but clipping it keeps the group's order and sum
    for scale in ("batch", "none"):
        adv, _ = grpo_advantages(scores, g, scale, n_sigma=3.0)
        assert adv.view(-1, g).sum(-1).abs().max().item() < 1e-5 and adv[3].item() > 0


def test_ppo_per_token_rewards_kl_sign_and_score_position():
    scores = torch.tensor([2.0, -1.0])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.5, -3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # three and two completion tokens
    rewards = per_token_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    # r_t = -0.1 * (logp - ref): above the reference costs reward; the score lands on the last real token
    assert rewards[0].tolist() == pytest.approx([-0.05, 0.1, 0.0 + 2.0, 0.0])
    assert rewards[1].tolist() == pytest.approx([0.05, -0.2 - 1.0, 0.0, 0.0])
    silent = per_token_rewards(scores, logprobs, ref, torch.zeros_like(mask), kl_coef=0.1)
    assert (silent == 0).all()  # a row that does not train gets neither penalty nor score


def test_k3_log_ratio_is_clamped_like_the_policy_ratio():
    far = kl_k3(torch.tensor([-100.0]), torch.tensor([0.0]))  # the reference finds the token e^100 times likelier
    assert torch.isfinite(far).all() and far.item() == pytest.approx(math.exp(20.0) - 1 - 20.0, rel=1e-6)
    assert kl_k3(torch.tensor([-100.0]), torch.tensor([0.0]), clamp=5.0).item() == pytest.approx(math.exp(5) - 6)
    assert kl_k3(torch.tensor([-1.0]).bfloat16(), torch.tensor([-1.0])).dtype == torch.float32


def test_adaptive_kl_error_is_clipped_at_two_tenths():
    assert adaptive_kl_coef(0.05, kl=10.0, target=0.1) == pytest.approx(0.05 * 1.02)  # not 0.05 * 1.1
    assert adaptive_kl_coef(0.05, kl=0.0, target=0.1) == pytest.approx(0.05 * 0.98)
    assert adaptive_kl_coef(0.05, kl=0.11, target=0.1) == pytest.approx(0.05 * (1 + 0.1 * 0.1))


def test_masked_mean_ignores_padding_and_is_zero_when_empty():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3, not / 6
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_divides_by_the_population_std():
    white = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 50.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    unit = 1 / math.sqrt(2 / 3)  # population variance of (1, 2, 3) is 2/3 (Bessel's would give 1)
    assert white[0].tolist() == pytest.approx([-unit, 0.0, unit, 0.0], rel=1e-6)


def test_whiten_scores_uses_the_unbiased_std_and_leaves_a_single_score_alone():
    white = whiten_scores(torch.tensor([1.0, 2.0, 3.0]))
    assert white.tolist() == pytest.approx([-1.0, 0.0, 1.0], rel=1e-6)  # unbiased std of (1, 2, 3) is 1
    assert whiten_scores(torch.tensor([5.0])).tolist() == [5.0]


def test_sigma_clip_takes_mean_and_std_over_the_mask_only():
    x = torch.tensor([[0.0, 0.0, 0.0, 10.0, -99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    clipped, count = sigma_clip(x, 1.0, mask)
    mean = 2.5  # the masked -99 takes no part
    std = math.sqrt((3 * 2.5 ** 2 + 7.5 ** 2) / 4)
    assert count == 1  # the 10, not the masked -99
    assert clipped[0].tolist() == pytest.approx([0.0, 0.0, 0.0, mean + std, 0.0], rel=1e-6)


def test_all_equal_groups_names_the_groups_group_advantages_counts():
    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0, 5.0, 3.0, 3.0 + 1e-3])
    assert all_equal_groups(scores, 2) == [0, 2]
    assert group_advantages(scores, 2, "group")[1] == 2
    assert all_equal_groups(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2) == []


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert explained_variance(returns, values, mask) == pytest.approx(1 - (1 / 3) / (2 / 3))  # 0.5
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3)) == 0.0  # constant returns


def fake_run(forward: PolicyForward, **settings):
    """What an algorithm's ``minibatch`` reads from its run: settings, the envelope, PPO's KL coefficient, the phase
    clock, the shared forward (here ``forward``, made by hand), the ratio guard (not tripping) and the guarded step
    (here handing the loss back instead of stepping)."""
    rl = RLSettings(max_new_tokens=2, **settings)
    guard = SimpleNamespace(step=lambda loss, snapshot, after_backward: {"loss": loss})
    return SimpleNamespace(settings=rl, envelope=EnvelopeSettings(), kl_coef=0.3, clock=PhaseClock(), guard=guard,
                           policy_forward=lambda batch, rows: forward, ratio_guard_skips=lambda fwd: False,
                           after_backward=None)


def minibatch_loss(algorithm, run, batch, rows, advantages: Advantages):
    """``algorithm``'s minibatch on a :func:`fake_run`: the loss its guarded step got, and its statistics."""
    result = algorithm.minibatch(run, batch, rows, advantages)
    return result.pop("loss"), result


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
    forward = PolicyForward(rows, new, torch.tensor([[0.0, 0.0]]), ratio, mask, {}, None)
    run = fake_run(forward, ppo=PPOSettings(value_coef=0.25, kl_mode=kl_mode))
    loss, stats = minibatch_loss(PPO, run, batch, rows, Advantages(advantages, returns))
    policy = 0.0  # ratio 1: -(1 * 1 + (-1) * 1) / 2
    value = 0.5 * (4.0 + 0.0) / 2  # V = V_old = 0, R = (2, 0)
    k3 = masked_mean(kl_k3(new, ref), mask).item() if kl_mode == "loss" else 0.0
    assert stats["loss/policy"] == pytest.approx(policy) and stats["loss/value"] == pytest.approx(value)
    assert loss.item() == pytest.approx(policy + 0.25 * value + 0.3 * k3)


def test_grpo_loss_adds_beta_times_the_k3_kl_with_the_same_normalisation():
    rows, new, ref, mask, ratio, batch = loss_inputs()
    mask = torch.tensor([[1.0, 0.0]])  # one token trains: dr_grpo divides by B * max_new_tokens = 2
    advantages = torch.tensor([[2.0, 5.0]])
    forward = PolicyForward(rows, new, None, ratio, mask, {}, None)
    run = fake_run(forward, grpo=GRPOSettings(beta=0.5, loss_type="dr_grpo"))
    loss, stats = minibatch_loss(GRPO, run, batch, rows, Advantages(advantages))
    k3 = math.exp(-0.5) - 1 + 0.5  # d = log pi_ref - log pi = -0.5 on the token that trains
    assert stats["loss/policy"] == pytest.approx(-2.0 / 2)
    assert loss.item() == pytest.approx(-2.0 / 2 + 0.5 * k3 / 2)


def test_seed_streams_are_the_formulas_of_the_first_release():
    """The quickstart's figures for a fixed seed depend on these integers: they must never move."""
    seed, step, rank, epoch = 42, 7, 1, 1
    assert derive_seed(seed, "prompts", step) == seed * 1_000_003 + step
    assert derive_seed(seed, "rollout", step, rank) == seed * 7919 + step + 100_003 * rank
    assert derive_seed(seed, "resample", step, rank) == seed * 7919 + step + 100_003 * rank + 104729
    assert derive_seed(seed, "minibatch_order", step, epoch=epoch) == seed * 31 + step * 1009 + epoch
    assert derive_seed(seed, "preference_order", 0, epoch=epoch) == seed * 37 + epoch * 1013  # DPO/KTO, added later
    assert set(SEED_STREAMS) == {"prompts", "rollout", "resample", "minibatch_order", "preference_order"}


def test_iteration_size_is_the_same_number_of_samples_for_both_algorithms():
    grpo = iteration_size(RLSettings(algo="grpo", prompts_per_step=3, group_size=4))
    ppo = iteration_size(RLSettings(algo="ppo", prompts_per_step=3, group_size=4))
    assert (grpo.prompts, grpo.completions_per_prompt, grpo.samples) == (3, 4, 12)
    assert (ppo.prompts, ppo.completions_per_prompt, ppo.samples) == (12, 1, 12)
