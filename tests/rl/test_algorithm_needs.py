"""What each RL algorithm says it needs, read by the stage and the watchdog instead of ``algo ==`` checks."""

import pytest

from slm_align.config import load_recipe
from slm_align.envelope.world import World
from slm_align.errors import UserError
from slm_align.rl.algorithms import ALGORITHMS, rl_algorithm
from slm_align.rl.grpo import GRPO
from slm_align.rl.ppo import PPO
from slm_align.rl.stage import check_divisible


def bare(algorithm):
    """The learner without a model: only the KL bookkeeping is exercised."""
    learner = object.__new__(algorithm)
    learner.settings = load_recipe().rl
    learner.kl_coef = 0.1
    return learner


def test_only_ppo_asks_for_a_value_head():
    assert [name for name, algorithm in ALGORITHMS.items() if algorithm.needs_value_head] == ["ppo"]


def test_ppo_raises_the_coefficient_in_its_state_and_a_rollback_leaves_it():
    ppo = bare(PPO)
    ppo.raise_kl(2.0, base_beta=0.04, scale=3.0)
    assert ppo.kl_weight() == pytest.approx(0.2)
    ppo.rescale_kl(0.04, 5.0)
    assert ppo.kl_weight() == pytest.approx(0.2)


def test_grpo_weighs_the_recipe_beta_scaled_from_its_base():
    grpo = bare(GRPO)
    grpo.raise_kl(2.0, base_beta=0.04, scale=3.0)
    assert grpo.kl_weight() == pytest.approx(0.12)
    assert grpo.kl_coef == 0.1  # PPO's coefficient is not GRPO's weight
    grpo.rescale_kl(0.04, 1.0)
    assert grpo.kl_weight() == pytest.approx(0.04)


def test_each_algorithm_says_what_ranks_share_and_a_world_that_cannot_split_it_is_refused():
    settings = load_recipe(overrides={"rl.prompts_per_step": 3, "rl.group_size": 2}).rl
    assert (PPO.draw_unit, GRPO.draw_unit) == ("samples", "prompts")
    check_divisible(settings.model_copy(update={"algo": "ppo"}), World(0, 2))  # 6 samples over 2
    with pytest.raises(UserError, match="2 processes cannot share 3 prompts per iteration"):
        check_divisible(settings.model_copy(update={"algo": "grpo"}), World(0, 2))


def test_auto_is_refused_only_when_no_algorithm_the_gate_may_choose_can_split_it():
    settings = load_recipe(overrides={"rl.prompts_per_step": 3, "rl.group_size": 2, "rl.algo": "auto"}).rl
    check_divisible(settings, World(0, 2))  # GRPO's 3 prompts do not split, PPO's 6 samples do
    with pytest.raises(UserError, match="4 processes cannot share 6 samples per iteration"):
        check_divisible(settings, World(0, 4))


def test_an_unknown_name_is_refused_with_the_choices():
    assert rl_algorithm("grpo") is GRPO
    with pytest.raises(UserError, match="choose one of ppo, grpo"):
        rl_algorithm("dpo")
