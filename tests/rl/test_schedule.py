"""An RL iteration's size: PPO and GRPO draw the same number of samples."""

from slm_align.config import RLSettings
from slm_align.rl.schedule import iteration_size


def test_iteration_size_is_the_same_number_of_samples_for_both_algorithms():
    grpo = iteration_size(RLSettings(algo="grpo", prompts_per_step=3, group_size=4))
    ppo = iteration_size(RLSettings(algo="ppo", prompts_per_step=3, group_size=4))
    assert (grpo.prompts, grpo.completions_per_prompt, grpo.samples) == (3, 4, 12)
    assert (ppo.prompts, ppo.completions_per_prompt, ppo.samples) == (12, 1, 12)
