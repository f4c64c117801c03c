"""What each RL algorithm says it needs, read by the stage and the watchdog instead of ``algo ==`` checks."""

import pytest

from slm_align.config import load_recipe
from slm_align.rl.grpo import GRPO
from slm_align.rl.ppo import PPO
from slm_align.rl.stage import ALGORITHMS


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
