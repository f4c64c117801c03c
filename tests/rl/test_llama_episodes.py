"""Agent episodes sampled by the runtime's own llama.cpp backend (rl.sampler = llama_cpp with task rows):
each sampled id's llama.cpp log-probability is kept, the runtime's inserted ids get none, the trainer's
scores of the same ids agree, and llama.cpp's chain at the temperature samples what those numbers say."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from slm_align.data.tasks import TaskSet
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.modeling.models import load_tokenizer, resolve_source
from slm_align.ondevice.agent.prompt import PromptFitter
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.rl.llama_episodes import tempered_logprob
from slm_align.rl.llama_sampler import LlamaSampler
from slm_align.rollouts.episodes import AgentTasks, backend_episodes, episode_params, pack, sampler_logprobs
from slm_align.rollouts.policy_backend import policy_template
from tests.helpers import random_lora
from tests.rollouts.test_episodes import half_caller, settings, train_on_tasks, trained_metrics  # noqa: F401


@pytest.fixture()
def episode_sampler(half_caller, tmp_path):  # noqa: F811
    """The half-calling tiny model under a small random LoRA, and a llama.cpp sampler (F32 base) whose
    runtime backend runs episodes with that LoRA swapped in."""
    source = resolve_source(str(half_caller))
    tokenizer = load_tokenizer(source)
    policy = random_lora(half_caller, ["q_proj", "v_proj"], seed=1, r=4, lora_alpha=2)
    sampler = LlamaSampler(policy, tokenizer, source, tmp_path, "F32", threads=1, n_ctx=256)
    sampler.for_episodes(policy_template(tokenizer), 512)
    sampler.refresh(policy)
    yield policy, tokenizer, sampler
    sampler.close()


def trainer_scores(policy, episodes, tokenizer, adapter=True):
    input_ids, attention, width, mask = pack(episodes, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        if adapter:
            return forward_logprobs(policy, input_ids, attention, width, 1.0)[0], mask
        with policy.disable_adapter():
            return forward_logprobs(policy, input_ids, attention, width, 1.0)[0], mask


@pytest.mark.parametrize("runner", ["backend", "episode_runner"])
def test_llama_cpp_episodes_are_scored_by_the_trainer_token_for_token(episode_sampler, runner):
    """On the runtime's backend one episode after another, and on what RL runs them on (a batching decoder over
    the same model once llama.cpp batching is in the tree, every episode a sequence of one context)."""
    policy, tokenizer, sampler = episode_sampler
    tasks = AgentTasks(TaskSet(["What is 2+3?"] * 8, [{"answer": "5"}] * 8))
    backend = sampler.episodes if runner == "backend" else sampler.episode_runner(8)
    episodes = backend_episodes(backend, ["What is 2+3?"] * 8, settings(max_new_tokens=32), 0, tasks)
    assert any(e.rounds >= 1 for e in episodes)  # some called the calculator: inserted ids between the rounds
    logprobs, mask = trainer_scores(policy, episodes, tokenizer)
    drawn = sampler_logprobs(episodes, mask.shape[1], "cpu")
    assert (mask == 0).any() and torch.all(drawn[mask == 0] == 0)  # inserted ids and padding carry nothing
    gap = float(((logprobs - drawn).abs() * mask).sum() / mask.sum())
    assert gap < 1e-3, gap
    # One position off (an inserted id counted as sampled) breaks it; so does the adapter left out.
    shifted = torch.roll(drawn, 1, dims=1)
    assert float(((logprobs - shifted).abs() * mask).sum() / mask.sum()) > 20 * gap
    base, _ = trainer_scores(policy, episodes, tokenizer, adapter=False)
    assert float(((base - drawn).abs() * mask).sum() / mask.sum()) > 20 * gap


def test_llama_cpps_chain_at_the_temperature_draws_what_the_kept_log_probabilities_say(episode_sampler):
    """The first token of 600 replies against softmax(logits / T): its most likely token and the mass outside
    its 40 most likely tokens (llama.cpp's default top-k would leave none there) within 4 sigma."""
    _, _, sampler = episode_sampler
    backend = sampler.episodes
    prompt, _ = PromptFitter(backend, default_tools().specs()).fit([{"role": "user", "content": "Hello"}], 64)
    params = episode_params(settings(temperature=2.0), 0, 0)
    draws = []
    for seed in range(600):
        generator = backend.generate(prompt, replace(params, seed=seed))
        draws.append(next(generator))
        if seed == 0:  # the logits every first token is drawn from
            scaled = torch.log_softmax(torch.from_numpy(backend.last_logits()).double() / 2.0, -1)
        generator.close()
    order = torch.argsort(scaled, descending=True)
    probabilities = {"top": float(scaled[order[0]].exp()), "tail": float(scaled[order[40:]].exp().sum())}
    seen = {"top": np.mean([d == int(order[0]) for d in draws]),
            "tail": np.mean([d in set(order[40:].tolist()) for d in draws])}
    assert probabilities["tail"] > 0.05  # the test can see a top-k cut
    for name, p in probabilities.items():
        assert abs(seen[name] - p) < 4 * math.sqrt(p * (1 - p) / len(draws)), (name, seen[name], p)


def test_the_kept_log_probability_is_the_tempered_softmax():
    logits = np.array([2.0, 0.5, -1.0, 3.0], dtype=np.float32)
    for temperature in (0.7, 1.0, 2.0):
        expected = torch.log_softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1)
        assert all(tempered_logprob(logits, t, temperature) == pytest.approx(float(expected[t]), abs=1e-12)
                   for t in range(4))


def test_each_refresh_swaps_the_adapter_and_frees_the_last(episode_sampler):
    policy, tokenizer, sampler = episode_sampler
    backend = sampler.episodes
    first = [entry["sha256"] for entry in backend.adapters]
    for name, parameter in policy.named_parameters():
        if "lora_B" in name:
            parameter.data.mul_(-1)
    sampler.refresh(policy)
    assert [entry["sha256"] for entry in backend.adapters] != first
    assert list(backend._loaded) == [entry["sha256"] for entry in backend.adapters]  # the old handle is freed


def test_train_grpo_on_episodes_with_the_llama_cpp_sampler_from_the_cli(tmp_path, capsys, tiny_models):
    run, _ = train_on_tasks(tmp_path, capsys, tiny_models, "--set", "rl.sampler=llama_cpp", "--set",
                            "rl.sampler_base=F32")
    manifest, lines = trained_metrics(run)
    assert manifest["metrics"]["episodes"] is True and manifest["inputs"]["rl"]["sampler"] == "llama_cpp"
    assert len(lines) == 2
    for line in lines:
        assert 0.0 <= line["sampler/kl"] < 1e-4 and line["sampler/capped_frac"] == 0.0
        assert "episode/call_rate" in line and line["time/sampler_sync"] > 0
