"""The RL learning rate, when the recipe leaves it unset, falls with the model's size."""

import pytest

from slm_align.config import load_recipe
from slm_align.envelope.learning_rate import base_parameters, default_learning_rate, warmup_factor
from slm_align.modeling.models import attach_lora, build_tiny_model
from slm_align.rl.learner import RolloutSource
from slm_align.rl.ppo import PPO


def test_rate_by_size():
    assert default_learning_rate(2_503_488) == pytest.approx(1e-3)  # the bundled model keeps its tuned rate
    assert default_learning_rate(30_000) == pytest.approx(1e-3)  # tiny test models too
    assert default_learning_rate(135_000_000) == pytest.approx(1.4e-4, rel=0.05)
    assert default_learning_rate(268_098_176) == pytest.approx(1e-4, rel=0.05)  # Gemma 3 270M, measured
    assert default_learning_rate(500_000_000) == pytest.approx(7.2e-5, rel=0.05)
    assert default_learning_rate(10**12) == pytest.approx(1e-5)  # never below the paper's rate


@pytest.mark.parametrize("recipe_rate", [None, 3e-4])
def test_loop_uses_the_recipe_rate_or_the_scaled_default(tokenizer, recipe_rate):
    recipe = load_recipe(overrides={"rl.learning_rate": recipe_rate})
    policy = attach_lora(build_tiny_model("llama", len(tokenizer), hidden=64, layers=2), recipe.rl.lora, 0)
    loop = PPO(policy, tokenizer, None, RolloutSource(["a"]), recipe.rl, seed=0)
    expected = recipe_rate if recipe_rate is not None else default_learning_rate(base_parameters(policy))
    assert loop.learning_rate == pytest.approx(expected)
    assert loop.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert base_parameters(policy) == sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n)


def test_warmup_rises_linearly_to_the_full_rate_and_is_off_at_zero():
    assert [warmup_factor(step, 2) for step in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    assert [warmup_factor(step, 0) for step in range(3)] == [1.0, 1.0, 1.0]
    assert warmup_factor(0, 4) == pytest.approx(0.2)  # never 0: the first update still moves
