"""An RL iteration's size, as each algorithm says it: PPO and GRPO draw the same number of
samples."""

from slm_align.config import RLSettings
from slm_align.rl.grpo import GRPO
from slm_align.rl.ppo import PPO


def test_iteration_size_is_the_same_number_of_samples_for_both_algorithms():
    settings = RLSettings(prompts_per_step=3, group_size=4)
    grpo = GRPO.iteration_size(settings)
    ppo = PPO.iteration_size(settings)
    assert (grpo.prompts, grpo.completions_per_prompt, grpo.samples) == (3, 4, 12)
    assert (ppo.prompts, ppo.completions_per_prompt, ppo.samples) == (12, 1, 12)
