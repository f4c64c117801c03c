"""Advantages on hand-computed inputs (GAE, group normalisation, whitening, the sigma clip, PPO's
per-token rewards): each test fails on a flipped sign, a wrong normaliser or a misplaced index."""

import math

import pytest
import torch

from slm_align.rl.advantages import (
    all_equal_groups,
    compact,
    gae,
    gae_over_trained,
    group_advantages,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    per_token_rewards,
    sigma_clip,
    whiten_scores,
)


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
    x = torch.tensor([0.0] * 98 + [1.0, 100.0])
    clipped, count = sigma_clip(x, 3.0)
    mean, std = x.mean(), x.std(unbiased=False)
    assert count == 1 and clipped.max().item() == pytest.approx((mean + 3 * std).item())
    assert sigma_clip(x, 0.0) == (x, 0)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    white = masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), mask)
    assert white[:3].mean().item() == pytest.approx(0.0, abs=1e-6) and white[3].item() == 0.0


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
    assert clipped == 0  # the raw 1 is over 3 sigma of the batch, but pass/fail scores have no outlier
    for scale in ("batch", "none"):
        adv, _ = grpo_advantages(scores, g, scale, n_sigma=3.0)
        assert adv.view(-1, g).sum(-1).abs().max().item() < 1e-5 and adv[3].item() > 0


def test_a_lone_success_keeps_its_unscaled_advantage_and_a_real_outlier_is_still_cut():
    g = 8
    scores = torch.zeros(8 * g)  # one success in 64: 1.6% of the batch, z = 7.9
    scores[3] = 1.0
    adv, clipped = grpo_advantages(scores, g, "none", n_sigma=3.0)
    assert clipped == 0
    assert adv[3].item() == pytest.approx(1 - 1 / g)  # 0.875, not 0.484
    spread = torch.linspace(0.0, 1.0, 8 * g)
    spread[3] = 100.0  # a reward model's blow-up among graded scores
    adv, clipped = grpo_advantages(spread, g, "none", n_sigma=3.0)
    mean = spread.mean()
    high = (mean + 3 * (spread - mean).pow(2).mean().sqrt()).item()
    assert clipped == 1
    group = spread[:g].clone()
    group[3] = high
    assert adv[3].item() == pytest.approx((group[3] - group.mean()).item(), rel=1e-5)


def test_ppo_per_token_rewards_kl_sign_and_score_position():
    scores = torch.tensor([2.0, -1.0])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.5, -3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # three and two completion tokens
    rewards = per_token_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    # r_t = -0.1 * (logp - ref): above the reference costs reward; the score
    # lands on the last real token
    assert rewards[0].tolist() == pytest.approx([-0.05, 0.1, 0.0 + 2.0, 0.0])
    assert rewards[1].tolist() == pytest.approx([0.05, -0.2 - 1.0, 0.0, 0.0])
    silent = per_token_rewards(scores, logprobs, ref, torch.zeros_like(mask), kl_coef=0.1)
    assert (silent == 0).all()  # a row that does not train gets neither penalty nor score


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
    x = torch.tensor([[0.0, 0.0, 1.0, 10.0, -99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    clipped, count = sigma_clip(x, 1.0, mask)
    mean = 2.75  # the masked -99 takes no part
    std = math.sqrt((2 * 2.75 ** 2 + 1.75 ** 2 + 7.25 ** 2) / 4)
    assert count == 1  # the 10, not the masked -99
    assert clipped[0].tolist() == pytest.approx([0.0, 0.0, 1.0, mean + std, 0.0], rel=1e-6)


def test_pass_fail_scores_are_never_clipped_even_when_a_level_is_rare():
    x = torch.tensor([0.0] * 99 + [1.0])
    assert sigma_clip(x, 3.0) == (x, 0)
    mask = torch.tensor([1.0] * 99 + [1.0])
    mask[0] = 0.0
    x[0] = 50.0  # a third value, but under the mask's zero: still two levels
    clipped, count = sigma_clip(x, 3.0, mask)
    assert count == 0 and clipped[-1].item() == 1.0


def test_all_equal_groups_names_the_groups_group_advantages_counts():
    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0, 5.0, 3.0, 3.0 + 1e-3])
    assert all_equal_groups(scores, 2) == [0, 2]
    assert group_advantages(scores, 2, "group")[1] == 2
    assert all_equal_groups(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2) == []


def test_gae_over_an_episode_skips_the_inserted_tokens_by_hand():
    """Sampled, sampled, inserted, inserted, sampled: the score lands on the last sampled token, each
    step bootstraps from the next sampled token's value, and the inserted tokens' values (9) never
    leak in. GAE over the gapped mask as it stands would put the score on an inserted position."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.1]])
    zeros = torch.zeros_like(mask)
    scores = torch.tensor([1.0])
    advantages, returns = gae_over_trained(scores, zeros, zeros, values, mask, kl_coef=0.0, gamma=1.0, lam=0.5)
    a2 = 1.0 - 0.1
    a1 = (0.1 - 0.2) + 0.5 * a2
    a0 = (0.2 - 0.5) + 0.5 * a1
    assert advantages[0].tolist() == pytest.approx([a0, a1, 0.0, 0.0, a2])
    assert returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, 0.0, 0.0, a2 + 0.1])
    naive, _ = gae(per_token_rewards(scores, zeros, zeros, mask, 0.0), values, mask, 1.0, 0.5)
    assert naive[0, 4] != pytest.approx(a2)


def test_gae_over_a_single_completion_is_plain_gae():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.3, -0.2, 0.4, 5.0], [0.7, 5.0, 5.0, 5.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, 0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.2, -1.0, -0.7, 0.0], [-0.1, 0.0, 0.0, 0.0]])
    scores = torch.tensor([0.8, -0.4])
    expected = gae(per_token_rewards(scores, logprobs, ref, mask, 0.1), values, mask, 0.9, 0.95)
    got = gae_over_trained(scores, logprobs, ref, values, mask, 0.1, 0.9, 0.95)
    assert torch.allclose(got[0], expected[0]) and torch.allclose(got[1], expected[1])


def test_compact_moves_each_rows_trained_positions_to_the_front_in_order():
    index, kept = compact(torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert index.tolist() == [[1, 3, 0], [0, 1, 2], [0, 0, 0]]
    assert kept.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
