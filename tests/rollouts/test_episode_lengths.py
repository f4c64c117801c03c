"""Lengths of agent episodes count what the policy sampled in each round: the watchdog's
``completion/length`` and the length penalty, on simulated episodes (no model), with fixed seeds.

An agent that learns to call a tool gets more rounds and, after each call, the tool's result
inserted by the runtime; neither is the policy writing longer. Counted over the whole sequence, a
call rate rising from 0.3 to 0.8 fired the length-inflation detector in every simulated run."""

import random

import pytest
import torch

from slm_align.config import RLSettings, WatchdogSettings
from slm_align.envelope.watchdog import Watchdog
from slm_align.rl.learner import rollout_metrics
from slm_align.rollouts.completions import Rollout, replace_rows, tokens_over, truncation_rules
from slm_align.rollouts.episodes import Episode, _trace_ids, pack, round_tokens


def trace_of(rng: random.Random, call_rate: float, round_scale: float = 1.0) -> list[tuple[str, list[int]]]:
    """A runtime trace of one simulated episode: a prompt of 20 ids; with chance ``call_rate`` one
    or two tool rounds, each 15-35 sampled ids (the call) and 40-90 inserted ids (the tool's
    result and the template around it); then a final answer of 15-35 sampled ids. Sampled counts
    scale by ``round_scale``."""
    trace = [("prompt", [1] * 20)]
    rounds = rng.choice((1, 2)) if rng.random() < call_rate else 0
    for _ in range(rounds):
        trace.append(("sampled", [2] * round(rng.randint(15, 35) * round_scale)))
        trace.append(("inserted", [3] * rng.randint(40, 90)))
    trace.append(("sampled", [2] * round(rng.randint(15, 35) * round_scale)))
    return trace


def episode_of(trace: list[tuple[str, list[int]]]) -> Episode:
    """The episode ``run_episode`` makes of a trace (ids, sampled flags, rounds)."""
    draws = [[0.0] * len(piece) for kind, piece in trace[1:] if kind == "sampled"]
    ids, sampled, logprobs, cut = _trace_ids(trace, draws)
    inserted = sum(1 for kind, _ in trace if kind == "inserted")
    return Episode("p", ids, len(trace[0][1]), sampled, "answer", [], inserted, cut, [], None, logprobs,
                   rerendered=cut, round_tokens=round_tokens(trace))


def rollout_of(episodes: list[Episode]) -> Rollout:
    """The rollout ``collect_episodes`` makes of episodes (no log-probability passes)."""
    input_ids, attention, width, mask = pack(episodes, 0, "cpu")
    size = len(episodes)
    return Rollout(["p"] * size, ["answer"] * size, input_ids, attention, width, mask, None, None, None,
                   torch.zeros(size), torch.zeros(size, dtype=torch.bool),
                   round_tokens=[e.round_tokens for e in episodes])


def length_metric(rng: random.Random, call_rate: float, round_scale: float = 1.0) -> float:
    """One iteration's ``completion/length`` over 32 simulated episodes."""
    episodes = [episode_of(trace_of(rng, call_rate, round_scale)) for _ in range(32)]
    return rollout_metrics(rollout_of(episodes), [{"ratio/max": 1.0}], None, 1.0)["completion/length"]


def inflation_fired(seed: int, rates: list[float], scales: list[float]) -> bool:
    """Whether the default watchdog's length detectors fire over iterations at these call rates
    and sampled-length scales."""
    rng = random.Random(seed)
    watchdog = Watchdog(WatchdogSettings())
    for rate, scale in zip(rates, scales):
        watchdog.observe({"completion/length": length_metric(rng, rate, scale)})
        trigger = watchdog.check()
        if trigger is not None:
            return trigger.detector == "length_inflation"
    return False


def test_round_tokens_count_sampled_ids_per_round_up_to_a_re_rendered_prompt():
    trace = [("prompt", [1] * 4), ("sampled", [2] * 3), ("inserted", [3] * 5), ("sampled", [2] * 4),
             ("inserted", [3] * 2), ("sampled", [2] * 6)]
    assert round_tokens(trace) == [3, 4, 6]
    cut = trace[:4] + [("prompt", [1] * 9), ("sampled", [2] * 6)]  # the context outgrew: ids stop there
    assert round_tokens(cut) == [3, 4] and episode_of(cut).round_tokens == [3, 4]
    episode = episode_of(trace)
    assert sum(episode.sampled) == sum(episode.round_tokens) == 13 and len(episode.ids) - 4 == 20


def test_an_episode_rollout_reports_sampled_tokens_per_round_and_a_completion_its_length():
    episodes = [episode_of(t) for t in ([("prompt", [1] * 4), ("sampled", [2] * 10), ("inserted", [3] * 50),
                                         ("sampled", [2] * 20)], [("prompt", [1] * 6), ("sampled", [2] * 9)])]
    batch = rollout_of(episodes)
    assert batch.lengths.tolist() == [80, 9]  # every id after the prompt
    assert batch.round_lengths.tolist() == [15.0, 9.0]  # (10 + 20) / 2 rounds; one round of 9
    single = Rollout(["p"], ["c"], batch.input_ids[1:], batch.attention_mask[1:], batch.prompt_width,
                     batch.mask[1:], None, None, None, torch.zeros(1), torch.zeros(1, dtype=torch.bool))
    assert single.round_lengths.tolist() == [9.0]  # a single completion: its length, as before
    merged = replace_rows(batch, [1], rollout_of([episodes[0]]), 0)
    assert merged.round_tokens == [[10, 20], [10, 20]]


def test_an_agent_learning_to_call_tools_is_no_length_inflation():
    rates = [0.3] * 10 + [0.3 + 0.5 * i / 20 for i in range(1, 21)] + [0.8] * 10  # 0.3 -> 0.8
    fired = [inflation_fired(seed, rates, [1.0] * len(rates)) for seed in range(10)]
    assert not any(fired)  # 100 runs counted over the whole sequence: 100%; sampled ids only: 75%


def test_rounds_that_really_grow_are_still_length_inflation():
    scales = [1.0] * 10 + [1.0 + i / 10 for i in range(1, 11)] + [2.0] * 10  # each round twice as long
    fired = [inflation_fired(seed, [0.3] * len(scales), scales) for seed in range(5)]
    assert all(fired)


def test_the_length_penalty_applies_the_per_round_budget_to_each_round():
    settings = RLSettings(max_new_tokens=40, length_penalty=0.1)  # 80%: 32 tokens a round
    rounds = [[30, 30, 30], [30, 40], [36]]
    mask = torch.ones((3, 90))
    assert tokens_over(mask, rounds, 32.0).tolist() == [0.0, 8.0, 4.0]
    scores, _ = truncation_rules(torch.zeros(3), mask, torch.zeros(3, dtype=torch.bool), settings, rounds)
    assert scores.tolist() == pytest.approx([0.0, -0.8, -0.4])  # the sum of 90 sampled ids: -5.8
    single = torch.zeros((2, 40))
    single[0, :36] = 1
    single[1, :20] = 1
    scores, _ = truncation_rules(torch.zeros(2), single, torch.zeros(2, dtype=torch.bool), settings)
    assert scores.tolist() == pytest.approx([-0.4, 0.0])  # one completion: unchanged
