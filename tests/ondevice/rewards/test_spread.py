"""The gate measures what the algorithms learn from: reward variation within a prompt,
and advises PPO or GRPO."""

from __future__ import annotations

import json

import pytest

from slm_align.ondevice.rewards.spread import group_size_for, measure_spread, projected_share, recommend


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
    from slm_align.headroom.stage import check_headroom

    recipe = load_recipe(overrides={"data.path": str(stories), "headroom.spread_prompts": 6,
                                    "headroom.max_new_tokens": 12, "headroom.max_documents": 8})
    report = check_headroom(recipe, run=None, rewards=[reward])
    return report.to_dict()


def test_the_gate_sees_no_signal_in_a_reward_of_the_prompt_alone(stories):
    report = _gate(stories, "tests.ondevice.rewards.test_spread:prompt_only")
    spread = report["info"]["reward_spread"]
    figure = report["figures"][-1]
    assert figure["name"].startswith("reward spread within prompts") and figure["value"] == 0.0
    assert not figure["passed"] and spread["between"] > 0 and spread["all_equal_share"] == 1.0
    assert spread["prompts"] == 6 and spread["k"] == 4 and report["info"]["spread_samples"] == 24
    assert report["info"]["recommendation"]["algo"] == "ppo"


def test_the_gate_passes_a_reward_that_varies_within_prompts(stories):
    report = _gate(stories, "tests.ondevice.rewards.test_spread:completion_length")
    figure = report["figures"][-1]
    assert figure["value"] > 0.1 and figure["passed"]
    assert report["info"]["reward_spread"]["all_equal_share"] < 0.5
    json.dumps(report)  # headroom.json holds it


def always_right(prompts, completions, **_):
    """Every sample succeeds: the policy already solves the task."""
    return [1.0] * len(completions)


always_right.bounds = (0.0, 1.0)


def always_wrong(prompts, completions, **_):
    """Every sample fails: the prior never reaches the reward."""
    return [0.0] * len(completions)


always_wrong.bounds = (0.0, 1.0)


def test_a_flat_spread_is_read_as_solved_unreached_or_flat():
    from slm_align.ondevice.rewards.spread import flat_case

    solved = flat_case([1.0] * 15 + [0.0], (0.0, 1.0))  # mean 0.94: nearly every sample succeeds
    assert solved.case == "solved" and solved.position == pytest.approx(15 / 16)
    assert solved.remedy.startswith("all samples succeed (15/16 samples at the reward's best 1")
    assert "SFT already solves the task" in solved.remedy and "fewer SFT steps" in solved.remedy
    unreached = flat_case([0.0] * 15 + [1.0], (0.0, 1.0))
    assert unreached.case == "unreached" and unreached.remedy.startswith("all samples fail (1/16")
    assert "cannot reach the reward" in unreached.remedy and "larger base model" in unreached.remedy
    mixed = flat_case([0.0] * 8 + [1.0] * 8, (0.0, 1.0))  # prompts all right or all wrong: flat within
    assert mixed.case == "flat" and "does not" not in mixed.remedy and "more discriminative" in mixed.remedy
    # the reward's own range decides, not the scores seen: 1.0 is the middle of a 0..2 reward
    assert flat_case([1.0] * 16, (0.0, 2.0)).case == "flat"
    assert flat_case([2.0] * 16, (0.0, 2.0)).case == "solved"
    unknown = flat_case([3.5] * 16, None)  # a learned reward model: success cannot be told
    assert unknown.case == "flat" and unknown.position is None and "range is unknown" in unknown.remedy


def test_reward_bounds_add_up_over_weighted_terms():
    from slm_align.ondevice.rewards.builtin import combine
    from slm_align.ondevice.rewards.protocol import reward_bounds

    assert reward_bounds(combine(["task_success", "call_format@0.2"])) == pytest.approx((0.0, 1.2))
    assert reward_bounds(combine(["exact_answer@-0.5", "length_window"])) == pytest.approx((-0.5, 1.0))
    assert reward_bounds(combine(["tests.ondevice.rewards.test_spread:prompt_only"])) is None  # no bounds: unknown
    assert reward_bounds(combine(["tool_task", "tests.ondevice.rewards.test_spread:prompt_only"])) is None


@pytest.mark.parametrize("reward, case, words", [
    ("always_right", "solved", "all samples succeed (24/24 samples at the reward's best 1"),
    ("always_wrong", "unreached", "all samples fail (0/24 samples at the reward's best 1"),
    ("prompt_only", "flat", "mixed but flat"),
])
def test_the_gate_says_which_case_its_flat_spread_is(stories, reward, case, words):
    report = _gate(stories, f"tests.ondevice.rewards.test_spread:{reward}")
    assert not report["passed"] and report["info"]["spread_case"]["case"] == case
    remedy = report["remedies"][-1]
    assert remedy.startswith(words) and remedy == report["info"]["spread_case"]["remedy"]
    other_remedies = {"solved": "SFT already solves", "unreached": "cannot reach the reward",
                      "flat": "more discriminative reward"}
    for other, text in other_remedies.items():
        assert (text in remedy) == (other == case)
