"""Direction: on a reward any policy can learn quickly, a few PPO or GRPO iterations raise it.

The bundled 2.5M story model (a tiny random model samples near-uniform tokens that LoRA cannot
reshape in a few steps) and a reward for brevity: fewer characters per completion score higher,
which the policy can reach by preferring short tokens or ending early. Held-out reward is measured
on fixed prompts with a fixed sampling seed.
"""

import statistics

import pytest
import torch

from slm_align.config import RLSettings
from slm_align.envelope.policy import build_policy, merged_for_sampling
from slm_align.envelope.value_head import ValueHead
from slm_align.modeling.generation import sample
from slm_align.modeling.models import DEFAULT_MODEL_DIR, resolve_source
from slm_align.rl.grpo import GRPO
from slm_align.rl.learner import RolloutSource
from slm_align.rl.ppo import PPO

PROMPTS = ["Once upon a time, there was a cat.", "Tom found a red ball.", "One day, Mia was happy.",
           "The sun was warm."]


def brevity(prompts, completions, **_):
    """Minus the characters of each completion, per 40."""
    return [-len(c) / 40 for c in completions]


def heldout_reward(policy, tokenizer) -> float:
    with merged_for_sampling(policy):
        samples = sample(policy, tokenizer, PROMPTS * 8, 8, 1.0, seed=123)
    return statistics.fmean(brevity(samples.prompts, samples.completions))


@pytest.fixture
def one_thread():
    """One intra-op thread: these matrices are small, and on a shared machine a second thread
    spin-waits (measured here: a rollout took 9 s of CPU on two threads, 0.2 s on one)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_few_iterations_raise_a_trivially_learnable_reward(algo, tokenizer, one_thread):
    rl = RLSettings(algo=algo, prompts_per_step=2, group_size=4, max_new_tokens=8, minibatch_size=8,
                    learning_rate=3e-3)
    policy = build_policy(resolve_source(str(DEFAULT_MODEL_DIR)), None, rl, seed=0)
    value_head = ValueHead(policy.config.hidden_size) if algo == "ppo" else None
    algorithm = PPO if algo == "ppo" else GRPO
    loop = algorithm(policy, tokenizer, brevity, RolloutSource(PROMPTS), rl, seed=0,
                     value_head=value_head)
    before = heldout_reward(policy, tokenizer)
    for step in range(10):
        loop.run_step(step)
    after = heldout_reward(policy, tokenizer)
    assert before < -0.6  # about 30 characters in 8 tokens to begin with
    assert after > before + 0.2, (before, after)  # the same sampling seed: an unchanged policy scores the same
    assert loop.counters.rollbacks == 0
