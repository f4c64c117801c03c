"""The batching PyTorch decoder RL episodes run on (slm_align.rollouts.policy_decoder): an episode's ids and sampled
log-probabilities are those it gets alone, whatever shares its forward, and the token contract of agent episodes
holds through an engine's lanes as through the one-conversation backend."""

from __future__ import annotations

import pytest
import torch

from slm_align.data.tasks import TaskSet
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.errors import UserError
from slm_align.ondevice.agent.batching import Engine, run_many
from slm_align.ondevice.agent.prompt import turn_end
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.rollouts.episodes import (
    AgentTasks,
    EpisodeSetup,
    backend_episodes,
    episode_params,
    pack,
    run_episode,
    sampler_logprobs,
)
from slm_align.rollouts.policy_backend import PolicyBackend
from slm_align.rollouts.policy_decoder import PolicyDecoder
from tests.rollouts.test_episodes import (
    ANSWER,
    CALL,
    Recording,
    Scripted,
    calculator_only,
    opening_of,
    settings,
    template,
    tiny,
)

PROMPTS = [f"Tell me about {thing}." for thing in ("cats", "the sea", "numbers", "a red door", "rain", "Paris",
                                                     "bread", "winter", "a bridge", "owls", "salt", "maps",
                                                     "a clock", "tea", "stones", "the moon")]


def tasks_of(prompts) -> AgentTasks:
    return AgentTasks(TaskSet(list(prompts), [{} for _ in prompts]))


def episodes_on(decoder_or_backend, prompts, temperature: float = 1.0, seed: int = 7):
    rl = settings(max_new_tokens=20, temperature=temperature)
    return backend_episodes(decoder_or_backend, list(prompts), rl, seed, tasks_of(prompts))


def params_of(temperature: float, index: int) -> SamplingParams:
    """Episode ``index``'s sampling: greedy at temperature 0 (RL's settings refuse it; the decoder follows it)."""
    return SamplingParams(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, max_tokens=20,
                          seed=1000 + index)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny(tiny_models)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_episode_is_the_same_alone_and_in_a_batch_of_16(model, tokenizer, temperature):
    """16 episodes, 8 prompts of different lengths twice each (a group's episodes share their prompt)."""
    prompts = PROMPTS[:8] * 2
    rl = settings(max_new_tokens=20)
    tasks = tasks_of(PROMPTS)
    decoder = PolicyDecoder(model, tokenizer, slots=16)

    def episode(lane, index):
        return run_episode(lane, prompts[index], tasks.open(prompts[index]), rl, params_of(temperature, index))

    with Engine(decoder) as engine:
        batched = run_many(engine, list(range(len(prompts))), episode)
    assert engine.stepped_rows > 2 * engine.steps  # rows shared forwards
    assert decoder.shared_prefills > 0  # a prompt computed once for both of its episodes
    for index, prompt in enumerate(prompts):
        alone = run_episode(PolicyBackend(model, tokenizer), prompt, tasks.open(prompt), rl,
                            params_of(temperature, index))
        assert batched[index].ids == alone.ids and batched[index].sampled == alone.sampled
        assert batched[index].round_tokens == alone.round_tokens
        assert torch.allclose(torch.tensor(batched[index].drawn_logprobs), torch.tensor(alone.drawn_logprobs),
                              atol=1e-4)
    if temperature > 0:  # real draws: the two episodes of a prompt differ (their own seeds)
        assert len({tuple(e.ids[e.prompt_length:]) for e in batched}) > 12


def test_rl_episodes_keep_episode_i_seed_i_through_the_engine(model, tokenizer):
    """backend_episodes on the decoder draws what the one-conversation backend draws, episode by episode."""
    batched = episodes_on(PolicyDecoder(model, tokenizer, slots=16), PROMPTS)
    alone = episodes_on(PolicyBackend(model, tokenizer), PROMPTS)
    assert [e.ids for e in batched] == [e.ids for e in alone]
    assert [e.sampled for e in batched] == [e.sampled for e in alone]


def test_the_batch_forward_decodes_rows_of_different_lengths_together(model, tokenizer):
    """Two slots of different cache lengths decoded in one forward get the logits each gets alone."""
    decoder = PolicyDecoder(model, tokenizer, slots=2)
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=1)
    short, long = tokenizer("hi there")["input_ids"], tokenizer("a much longer prompt than the other one")["input_ids"]
    for slot, prompt in enumerate((short, long)):
        decoder.begin(slot, params, None, prompt, logits=True)
    first = decoder.step({0: short, 1: long})
    forwards = decoder.forwards
    both = decoder.step({0: [first[0].token], 1: [first[1].token]})
    assert decoder.forwards == forwards + 1  # one forward for both rows
    for slot, prompt in enumerate((short, long)):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([prompt + [first[slot].token]])).logits[0, -1]
        assert torch.allclose(torch.from_numpy(both[slot].logits), alone, atol=1e-4)


def test_a_slot_freed_and_taken_again_starts_from_an_empty_cache(model, tokenizer):
    decoder = PolicyDecoder(model, tokenizer, slots=1)
    first = episodes_on(decoder, PROMPTS[:3])
    again = episodes_on(PolicyDecoder(model, tokenizer, slots=3), PROMPTS[:3])
    assert [e.ids for e in first] == [e.ids for e in again]


@pytest.mark.parametrize("name", [None, "qwen2.5-instruct.jinja", "qwen3.jinja", "smollm2-135m-instruct.jinja",
                                  "llama-3.2-instruct.jinja"])
def test_the_token_contract_holds_on_an_engines_lane(tiny_models, tokenizer, name):
    """A scripted call-then-answer episode on a lane: the same ids, mask and log-probabilities as on the
    one-conversation backend (whose contract tests/rollouts/test_episodes.py checks against the runtime's trace)."""
    backend = Recording(tiny(tiny_models), tokenizer, chat_template=template(name), n_ctx=4096)
    end = min(turn_end(backend) or {tokenizer.eos_token_id})
    backend.model = Scripted(backend.model, tokenizer, opening_of(backend), end, [CALL])
    rl = settings(max_tool_rounds=2, max_new_tokens=96)
    setup = EpisodeSetup([{"role": "user", "content": "What is 2+3?"}], calculator_only())
    alone = run_episode(backend, "What is 2+3?", setup, rl, episode_params(rl, 0, 0))
    decoder = PolicyDecoder(backend.model, tokenizer, slots=1, chat_template=template(name), n_ctx=4096)

    def episode(lane, _):
        return run_episode(lane, "What is 2+3?", setup, rl, episode_params(rl, 0, 0))

    with Engine(decoder) as engine:
        [laned] = run_many(engine, [0], episode)
    assert laned.answer == ANSWER and laned.calls[0]["ok"] and not laned.rerendered
    assert laned.ids == alone.ids and laned.sampled == alone.sampled and laned.round_tokens == alone.round_tokens
    assert False in laned.sampled  # the observation's ids are inserted, not sampled
    assert torch.allclose(torch.tensor(laned.drawn_logprobs), torch.tensor(alone.drawn_logprobs), atol=1e-4)


def test_a_grammar_or_inexact_setting_is_refused_on_the_decoder(model, tokenizer):
    decoder = PolicyDecoder(model, tokenizer, slots=1)
    exact = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=1)
    with pytest.raises(UserError, match="grammar"):
        decoder.begin(0, exact, "root ::= x", [1, 2], logits=False)
    with pytest.raises(UserError, match="top_k"):
        decoder.begin(0, SamplingParams(temperature=1.0, top_k=5, seed=1), None, [1, 2], logits=False)


def test_tools_run_per_episode_in_a_batch(model, tokenizer):
    """Unscripted episodes with every built-in tool on a batch: each has its own trace (ids start with its prompt)."""
    rl = settings(max_new_tokens=12, temperature=1.0)
    tasks = AgentTasks(TaskSet(PROMPTS[:4], [{} for _ in PROMPTS[:4]]), executables=default_tools())
    episodes = backend_episodes(PolicyDecoder(model, tokenizer, slots=4), PROMPTS[:4], rl, 3, tasks)
    for prompt, episode in zip(PROMPTS[:4], episodes):
        assert prompt in tokenizer.decode(episode.ids[:episode.prompt_length])
        assert len(episode.drawn_logprobs) == len(episode.sampled)


def test_past_gemma_3s_sliding_window_the_samplers_draw_what_the_trainer_scores(tiny_models, tokenizer):
    """Gemma 3's sliding-window layers: prompts wider than the window (8 here; 512 in the real model) sample
    on the decoder and alone, and every drawn log-probability is the one the update's forward gives. The
    model's own cache kept only the window's last positions, so a wider prefill used to fail to be kept."""
    model = tiny(tiny_models, "gemma3_text")
    prompts = PROMPTS[:4] * 2
    batched = episodes_on(PolicyDecoder(model, tokenizer, slots=8), prompts)
    alone = episodes_on(PolicyBackend(model, tokenizer), prompts)
    assert min(e.prompt_length for e in batched) > model.config.sliding_window
    assert [e.ids for e in batched] == [e.ids for e in alone]
    input_ids, attention, width, mask = pack(batched, tokenizer.pad_token_id, "cpu")
    assert input_ids.shape[1] > 2 * model.config.sliding_window
    with torch.no_grad():
        scored, _, _ = forward_logprobs(model, input_ids, attention, width, 1.0, with_entropy=False)
    drawn = sampler_logprobs(batched, mask.shape[1], "cpu")
    torch.testing.assert_close(scored * mask, drawn * mask, rtol=0, atol=1e-4)


def test_a_conversation_longer_than_the_window_keeps_its_shared_prefix_on_the_backend(tiny_models, tokenizer):
    """The next round's prompt shares a prefix wider than the window with the cache: the backend crops to it
    (the model's sliding-window cache refused to crop) and draws from the logits a fresh backend gets."""
    model = tiny(tiny_models, "gemma3_text")
    first = tokenizer(" ".join(PROMPTS))["input_ids"]
    assert len(first) > model.config.sliding_window
    backend = PolicyBackend(model, tokenizer)
    drawn = []
    for token in backend.generate(first, params_of(1.0, 0)):
        drawn.append(token)
        if len(drawn) == 5:
            break
    second = first + drawn[:3] + tokenizer(" and then")["input_ids"]
    fresh = PolicyBackend(model, tokenizer)
    for one in (backend, fresh):
        next(one.generate(second, params_of(1.0, 1)))
    assert backend.tokens == fresh.tokens == second
    torch.testing.assert_close(torch.from_numpy(backend.last_logits()), torch.from_numpy(fresh.last_logits()),
                               rtol=0, atol=1e-4)
