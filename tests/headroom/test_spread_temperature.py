"""The gate's reward spread is sampled at the temperature RL will sample at (issue 43): a prior that
fails every sample at 1.0 can succeed often enough at RL's 0.8 for GRPO's groups to differ."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import slm_align.headroom.stage as gate
import slm_align.modeling.generation as generation
from slm_align.config import Recipe


class Reward:
    terms = [("stub", None, 1.0)]


@pytest.fixture
def sampled_at(monkeypatch) -> list[float]:
    """The temperatures the gate's completions were sampled at; every other sample scores 1."""
    seen: list[float] = []

    def sample(policy, tokenizer, prompts, max_new_tokens, temperature, seed):
        seen.append(temperature)
        return [f"sample {i}" for i in range(len(prompts))]

    def score(reward, samples):
        return [float(i % 2) for i in range(len(samples))]

    monkeypatch.setattr(generation, "sample", sample)
    monkeypatch.setattr(generation, "score", score)
    return seen


def spread(recipe: Recipe) -> dict:
    info: dict = {}
    source = SimpleNamespace(tasks=None)
    gate._spread_figure(recipe, None, None, Reward(), ["a", "b", "c"], info, source)
    return info


def test_the_spread_is_sampled_at_rls_temperature(sampled_at):
    info = spread(Recipe.model_validate({"rl": {"temperature": 0.7}}))
    assert sampled_at == [0.7]
    assert info["spread_temperature"] == 0.7


def test_the_gates_own_temperature_wins_when_given(sampled_at):
    info = spread(Recipe.model_validate({"rl": {"temperature": 0.7}, "headroom": {"temperature": 1.3}}))
    assert sampled_at == [1.3]
    assert info["spread_temperature"] == 1.3


def test_agent_episodes_are_sampled_at_rls_temperature(monkeypatch):
    seen = []

    def run_episodes(policy, tokenizer, prompts, settings, seed, tasks):
        seen.append((settings.temperature, settings.max_new_tokens))
        return [None] * len(prompts)

    def episode_scores(reward, prompts, episodes):
        return [float(i % 2) for i in range(len(prompts))]

    def check_template(tokenizer):
        return None

    def agent_tasks(settings, given):
        return SimpleNamespace(check_template=check_template)

    monkeypatch.setattr(gate, "agent_tasks", agent_tasks)
    monkeypatch.setattr(gate, "run_episodes", run_episodes)
    monkeypatch.setattr(gate, "episode_scores", episode_scores)
    recipe = Recipe.model_validate({"rl": {"temperature": 0.8, "max_new_tokens": 96},
                                    "headroom": {"max_new_tokens": 48}})
    info: dict = {}
    gate._spread_figure(recipe, None, None, Reward(), ["a", "b"], info, SimpleNamespace(tasks=object()))
    assert seen == [(0.8, 48)]
    assert info["spread_unit"] == "agent episodes"


def test_a_runs_record_keeps_the_temperature_its_spread_was_sampled_at(tmp_path):
    """``check-headroom --run`` measures again at the temperature ``train``'s gate sampled at."""
    recipe = Recipe.model_validate({"rl": {"temperature": 0.6}})
    settings = gate.gate_request(recipe, tmp_path, None, ["function_call_match"])["settings"]
    assert settings["rl.temperature"] == 0.6
    assert settings["headroom.temperature"] is None


def test_a_gate_measured_at_another_temperature_is_not_reused(tmp_path):
    """``train`` reuses a recorded gate only when its inputs match: RL's temperature is one of them."""
    warm = Recipe.model_validate({"rl": {"temperature": 0.8}})
    hot = Recipe.model_validate({"rl": {"temperature": 1.0}})
    assert gate.gate_inputs(warm, None, None, None, []) != gate.gate_inputs(hot, None, None, None, [])
    assert gate.gate_inputs(warm, None, None, None, []) == gate.gate_inputs(warm, None, None, None, [])
