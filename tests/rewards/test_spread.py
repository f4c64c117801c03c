"""The gate measures what the algorithms learn from: reward variation within a prompt,
and advises PPO or GRPO."""

from __future__ import annotations

import json

import pytest

from slm_align.rewards.spread import group_size_for, measure_spread, projected_share, recommend


def prompt_only(prompts, completions, **_):
    """Depends on the prompt alone: every sample of a prompt gets the same reward."""
    return [float(len(prompt) % 7) for prompt in prompts]


def completion_length(prompts, completions, **_):
    """Depends on the completion: samples of one prompt differ."""
    return [float(len(completion)) for completion in completions]


def test_spread_separates_within_and_between_prompts():
    # two prompts, k=2: (1, 3) and (5, 5)
    spread = measure_spread([1.0, 3.0, 5.0, 5.0], 2)
    assert spread.within == pytest.approx((1.0 + 0.0) / 2)  # pstdev(1,3)=1, pstdev(5,5)=0
    assert spread.between == pytest.approx(1.5)  # means 2 and 5: pstdev = 1.5
    assert spread.all_equal_share == 0.5
    assert spread.overall == pytest.approx(1.6583123951777)  # pstdev of all four
    with pytest.raises(ValueError):
        measure_spread([1.0, 2.0, 3.0], 2)


def test_a_prompt_only_reward_has_no_within_prompt_spread():
    scores = [3.0, 3.0, 3.0, 1.0, 1.0, 1.0]
    spread = measure_spread(scores, 3)
    assert spread.within == 0.0 and spread.between == pytest.approx(1.0) and spread.all_equal_share == 1.0


def test_the_advice_flips_to_ppo_when_most_groups_are_all_equal():
    mostly_equal = measure_spread([1.0] * 4 * 8 + [0.0, 1.0, 0.0, 1.0] * 2, 4)  # 8 of 10 prompts all-equal
    varied = measure_spread([0.0, 1.0, 1.0, 0.0] * 9 + [1.0] * 4, 4)  # 1 of 10
    assert recommend(varied, 0.5, 8)["algo"] == "grpo"
    advice = recommend(mostly_equal, 0.5, 8)
    assert advice["algo"] == "ppo"
    assert "80% of prompts got identical rewards in 4 samples" in advice["why"]
    assert f"--group-size to {group_size_for(0.8, 4, 0.5)}" in advice["why"]
    # a larger configured group rescues GRPO when the projection says so: 0.8^(32/4) = 0.17 <= 0.5
    assert recommend(mostly_equal, 0.5, 32)["algo"] == "grpo"
    never = measure_spread([1.0] * 8, 4)
    assert "no group size would help" in recommend(never, 0.5, 8)["why"]


def test_group_size_projection():
    assert projected_share(0.5, 4, 8) == pytest.approx(0.25)
    assert group_size_for(0.8, 4, 0.5) == 13  # 4 * ln 0.5 / ln 0.8 = 12.4
    assert projected_share(0.8, 4, 13) <= 0.5 < projected_share(0.8, 4, 12)
    assert group_size_for(0.3, 4, 0.5) == 4
    assert group_size_for(1.0, 4, 0.5) == 0


def _gate(stories, reward: str):
    from slm_align.config import load_recipe
    from slm_align.headroom import check_headroom

    recipe = load_recipe(overrides={"data.path": str(stories), "headroom.spread_prompts": 6,
                                    "headroom.max_new_tokens": 12, "headroom.max_documents": 8})
    report = check_headroom(recipe, run=None, rewards=[reward])
    return report.to_dict()


def test_the_gate_sees_no_signal_in_a_reward_of_the_prompt_alone(stories):
    report = _gate(stories, "tests.rewards.test_spread:prompt_only")
    spread = report["info"]["reward_spread"]
    figure = report["figures"][-1]
    assert figure["name"].startswith("reward spread within prompts") and figure["value"] == 0.0
    assert not figure["passed"] and spread["between"] > 0 and spread["all_equal_share"] == 1.0
    assert spread["prompts"] == 6 and spread["k"] == 4 and report["info"]["spread_samples"] == 24
    assert report["info"]["recommendation"]["algo"] == "ppo"


def test_the_gate_passes_a_reward_that_varies_within_prompts(stories):
    report = _gate(stories, "tests.rewards.test_spread:completion_length")
    figure = report["figures"][-1]
    assert figure["value"] > 0.1 and figure["passed"]
    assert report["info"]["reward_spread"]["all_equal_share"] < 0.5
    json.dumps(report)  # headroom.json holds it
