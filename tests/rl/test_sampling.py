"""RL samples what it scores: the recipe alone sets sampling, dropout is off in every RL forward, a
truncated completion reaches the reward as written.

The policy here is a tiny GPT-2 (dropouts at GPT-2's default 0.1) whose checkpoint ships a
generation_config.json with a repetition penalty, an n-gram ban and top-k: everything a
real checkpoint may carry.
"""

import pytest
import torch

from slm_align.config import LoraSettings, RLSettings
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.envelope.policy import build_policy, merged_for_sampling
from slm_align.envelope.value_head import ValueHead
from slm_align.modeling.generation import sample
from slm_align.modeling.models import resolve_source
from slm_align.rl.learner import RolloutSource
from slm_align.rl.ppo import PPO
from slm_align.rollouts.completions import RolloutModels, collect
from tests.helpers import policy_with_moved_lora

PROMPTS = ["Once upon a time, there was a cat.",
           "Tom found a red ball.", "One day, Mia was happy.", "The sun."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A tiny GPT-2 with default dropouts and a generation config that would
    change what is sampled."""
    from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, vocab_size=len(tokenizer),
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(do_sample=True, repetition_penalty=1.3, no_repeat_ngram_size=2, top_k=5,
                                               bad_words_ids=[[tokenizer.convert_tokens_to_ids("a")]])
    path = tmp_path_factory.mktemp("gpt2_generation_config")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def settings(**update) -> RLSettings:
    base = dict(algo="ppo", prompts_per_step=4, group_size=2, max_new_tokens=12, minibatch_size=8,
                lora=LoraSettings(r=8, alpha=16.0, dropout=0.1))
    return RLSettings(**{**base, **update})


def trained_policy(checkpoint, rl: RLSettings):
    """The RL policy with its LoRA moved off zero, as after some updates (so LoRA
    dropout would matter)."""
    return policy_with_moved_lora(checkpoint, rl, 0.5, seed=1)


def sampled_and_recomputed(policy, tokenizer, temperature: float):
    """The sampler's own log-probabilities, and the old and reference log-probabilities
    the update recomputes."""
    policy.eval()
    with merged_for_sampling(policy):
        samples = sample(policy, tokenizer, PROMPTS * 2, 12, temperature, seed=0, with_logprobs=True)
    ids = torch.cat([samples.prompt_ids, samples.completion_ids], 1)
    attention = torch.cat([samples.prompt_mask, samples.completion_mask], 1)
    width = samples.prompt_ids.shape[1]
    with torch.no_grad():
        old, _, _ = forward_logprobs(policy, ids, attention, width, temperature)
        with policy.disable_adapter():
            ref, _, _ = forward_logprobs(policy, ids, attention, width, temperature)
    mask = samples.completion_mask.bool()
    return samples.logprobs[mask], old[mask], ref[mask]


def test_checkpoint_generation_config_does_not_leak_into_rollouts(checkpoint, tokenizer):
    policy = build_policy(resolve_source(str(checkpoint)), None, settings(), seed=0)
    assert policy.generation_config.repetition_penalty == 1.3  # the checkpoint's config was loaded
    sampled, old, _ = sampled_and_recomputed(policy, tokenizer, temperature=1.0)
    assert sampled.numel() > 40
    assert torch.allclose(sampled, old, atol=1e-4)  # the checkpoint's penalty would make them differ
    assert policy.generation_config.repetition_penalty == 1.3  # and it is back in place for the user


def test_sampling_through_a_trained_lora_samples_the_adapted_policy_at_temperature_0_7(checkpoint, tokenizer):
    policy = trained_policy(checkpoint, settings())
    sampled, old, ref = sampled_and_recomputed(policy, tokenizer, temperature=0.7)
    assert torch.allclose(sampled, old, atol=1e-4)  # old log-probabilities are the sampler's
    assert (old - ref).abs().max() > 0.5  # and they are the adapter's, not the reference's


def characters(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def test_dropout_is_off_in_every_rl_forward_so_the_first_ratio_is_exactly_one(checkpoint, tokenizer):
    rl = settings()
    policy = trained_policy(checkpoint, rl)
    value_head = ValueHead(policy.config.hidden_size)
    loop = PPO(policy, tokenizer, characters, RolloutSource(PROMPTS), rl, seed=0,
               value_head=value_head)
    batch = loop.rollout(0)
    result = loop.minibatch(batch, torch.arange(8), loop.advantages(batch))
    assert result["ratio/mean"] == 1.0 and result["ratio/max"] == 1.0  # not dropout noise around 1
    with torch.no_grad(), policy.disable_adapter():  # the same tokens after one update ...
        again, _, _ = forward_logprobs(policy, batch.input_ids, batch.attention_mask, batch.prompt_width,
                                       rl.temperature, with_entropy=False)
    assert torch.equal(again * batch.mask, batch.ref_logprobs * batch.mask)  # ... have a bit-identical reference


def recording_reward(log: list):
    def reward(prompts, completions, truncated=None, **_):
        log.append(list(truncated))
        return [1.0] * len(completions)
    return reward


def test_rollout_scores_completions_as_written_and_can_penalise_a_missing_eos(checkpoint, tokenizer):
    policy = build_policy(resolve_source(str(checkpoint)), None, settings(), seed=0)
    seen: list = []
    models = RolloutModels(policy, None, tokenizer, recording_reward(seen))
    batch = collect(models, PROMPTS, settings(max_new_tokens=3), seed=0)
    assert seen == [batch.truncated.tolist()] and all(seen[0])  # the reward knows which completions were cut
    assert batch.scores.tolist() == [1.0] * 4
    penalised = collect(models, PROMPTS, settings(max_new_tokens=3, missing_eos_penalty=0.75), seed=0)
    assert penalised.scores.tolist() == [0.25] * 4


def test_the_reward_model_sees_no_eos_on_a_truncated_completion(checkpoint, tokenizer, tmp_path):
    from slm_align.modeling.models import load_model
    from slm_align.scoring.learned_reward import LearnedReward
    from slm_align.scoring.reward_model import classifier_from_policy, encode_scored, sequence_rewards

    classifier = classifier_from_policy(load_model(resolve_source(str(checkpoint))), tokenizer.pad_token_id)
    torch.nn.init.normal_(classifier.score.weight, std=1.0)
    classifier.save_pretrained(tmp_path / "rm", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "rm")
    reward = LearnedReward(tmp_path / "rm")
    finished = encode_scored(tokenizer, "Tom found", " a red ball", 64)
    cut = encode_scored(tokenizer, "Tom found", " a red ball", 64, ended=False)
    assert finished[-1] == tokenizer.eos_token_id and cut == finished[:-1]
    as_written = sequence_rewards(reward.model, torch.tensor([cut]), torch.ones(1, len(cut), dtype=torch.long))
    scores = reward(["Tom found"] * 2, [" a red ball"] * 2, truncated=[True, False])
    assert scores[0] == pytest.approx(float(as_written.detach()), abs=1e-5) and scores[0] != pytest.approx(scores[1])
    assert reward(["Tom found"], [" a red ball"]) == pytest.approx(scores[1:])  # without the flag: finished text
