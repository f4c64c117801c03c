"""Where an RL iteration's time goes, and the passes it skips: the phases are logged with every
iteration, and GRPO's reference and old-log-probability passes run only when something uses them,
without changing the update."""

import pytest
import torch

from slm_align.config import WatchdogSettings
from slm_align.envelope.recovery import WatchedRun
from slm_align.envelope.watchdog import Watchdog
from slm_align.rl.grpo import GRPO
from slm_align.rollouts import phases
from slm_align.rollouts.phases import PHASES, PhaseClock
from tests.rl.test_guards import (
    NaNGradientLoop,
    lora_state,
    make_loop,
    optimizer_state,
    same_state,
    sft_run,  # noqa: F401  (the shared fixture)
)


class FakeCounter:
    """A perf_counter that advances by one second per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_clock_adds_up_each_phase_even_when_the_block_raises(monkeypatch):
    monkeypatch.setattr(phases.time, "perf_counter", FakeCounter())
    clock = PhaseClock()
    with clock.phase("sampling"):
        pass
    with clock.phase("sampling"):
        pass
    with pytest.raises(RuntimeError), clock.phase("update_backward"):
        raise RuntimeError("a failed step still took its time")
    assert clock.metrics() == {"time/sampler_sync": 0.0, "time/sampling": 2.0, "time/reward": 0.0,
                               "time/scoring_old": 0.0, "time/scoring_ref": 0.0, "time/update_forward": 0.0,
                               "time/update_backward": 1.0}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_every_iteration_logs_its_phases_and_they_fit_in_the_iteration(sft_run, algo):  # noqa: F811
    loop = make_loop(sft_run, algo=algo)
    for step in range(2):
        metrics = loop.run_step(step)
        timed = [metrics[f"time/{name}"] for name in PHASES]
        idle = {"sampler_sync"} | ({"scoring_old"} if algo == "grpo" else set())  # PyTorch samples here, and
        ran = [metrics[f"time/{name}"] for name in PHASES if name not in idle]  # GRPO's old log-probs are its
        assert all(seconds > 0 for seconds in ran)  # every other phase ran (beta > 0, two epochs: the passes)
        assert all(metrics[f"time/{name}"] == 0.0 for name in idle)
        assert sum(timed) <= metrics["step_time"]


def flat_probe(offset: int = 0) -> list[float]:
    """A watchdog probe that always scores 0 (on any seed ``offset``)."""
    return [0.0]


class ForcedPasses(GRPO):
    """GRPO that scores old and reference log-probabilities in passes of their own
    whether or not they are used."""

    def needs_old_pass(self) -> bool:
        return True

    def needs_reference(self) -> bool:
        return True

    def old_from_sampler(self) -> bool:
        return False


def test_no_reference_pass_at_beta_zero_unless_the_watchdog_reads_the_kl(sft_run, tmp_path):  # noqa: F811
    skipping = make_loop(sft_run, grpo={"beta": 0.0}, old_logprobs="recompute")  # old log-probs as forced's
    metrics = skipping.run_step(0)
    assert metrics["time/scoring_ref"] == 0.0 and metrics["kl"] is None
    forced = make_loop(sft_run, loop_class=ForcedPasses, grpo={"beta": 0.0})
    forced_metrics = forced.run_step(0)
    assert forced_metrics["time/scoring_ref"] > 0 and forced_metrics["kl"] is not None
    after = lora_state(skipping)
    assert all(torch.equal(after[name], value) for name, value in lora_state(forced).items())  # the same update
    watched = make_loop(sft_run, grpo={"beta": 0.0})
    WatchedRun(Watchdog(WatchdogSettings()), flat_probe, tmp_path, watched.world, print, 0.0).begin(watched)
    assert watched.kl_watched
    batch = watched.rollout(0)
    assert batch.ref_logprobs is not None  # the KL-runaway detector gets its metric


def test_one_minibatch_per_epoch_takes_its_old_logprobs_from_the_first_forward_and_updates_as_with_a_pass(
        sft_run):  # noqa: F811
    one_minibatch = dict(epochs=2, minibatch_size=16)  # 4 prompts x G=4: all 16 samples in each epoch's one step
    skipping = make_loop(sft_run, **one_minibatch)
    batch = skipping.rollout(0)
    assert batch.old_logprobs is None and skipping.clock.metrics()["time/scoring_old"] == 0.0
    adv = skipping.advantages(batch)
    first = skipping.minibatch(batch, torch.randperm(16), adv)
    assert first["ratio/mean"] == 1.0 and first["ratio/max"] == 1.0 and first["skipped"] == 0
    assert batch.old_logprobs is not None and batch.old_logprobs.shape == batch.mask.shape  # kept for epoch 2
    kept = batch.old_logprobs.clone()
    second = skipping.minibatch(batch, torch.randperm(16), adv)
    assert torch.equal(batch.old_logprobs, kept)  # epoch 2 compares with the rollout policy, not with epoch 1's
    assert second["ratio/mean"] != 1.0  # the first step moved the policy away from it
    forced = make_loop(sft_run, loop_class=ForcedPasses, **one_minibatch)
    again = make_loop(sft_run, **one_minibatch)
    again_metrics = again.run_step(0)
    forced_metrics = forced.run_step(0)
    assert again_metrics["time/scoring_old"] == 0.0 and forced_metrics["time/scoring_old"] > 0
    ours = lora_state(again)
    for name, value in lora_state(forced).items():
        assert torch.allclose(ours[name], value, rtol=0, atol=1e-7)  # the same two steps as with a pass of its own
    assert abs(again_metrics["kl"] - forced_metrics["kl"]) < 1e-5  # the KL metric reads the same old log-probs
    assert make_loop(sft_run).rollout(0).old_logprobs is not None  # two minibatches per epoch: the pass runs


def test_a_rolled_back_first_epoch_without_an_old_pass_leaves_the_rollout_policy_s_log_probs(sft_run):  # noqa: F811
    loop = make_loop(sft_run, loop_class=NaNGradientLoop, epochs=2, minibatch_size=16)
    forced = make_loop(sft_run, loop_class=ForcedPasses, epochs=2, minibatch_size=16)
    batch = loop.rollout(0)
    reference = forced.rollout(0)
    assert batch.old_logprobs is None  # the pass was skipped
    adv = loop.advantages(batch)
    params = lora_state(loop)
    state = optimizer_state(loop)
    loop.fault = True
    result = loop.minibatch(batch, torch.arange(16), adv)  # epoch 1: NaN gradient, rolled back
    assert result["rolled_back"] == 1
    assert same_state(lora_state(loop), params) and same_state(optimizer_state(loop), state)
    mask = batch.mask > 0
    assert torch.allclose(batch.old_logprobs[mask], reference.old_logprobs[mask], rtol=0, atol=1e-6)
    loop.fault = False
    second = loop.minibatch(batch, torch.arange(16), adv)  # epoch 2 starts from the unchanged policy
    assert second["ratio/mean"] == 1.0 and second["ratio/max"] == 1.0


def test_with_two_minibatches_an_epoch_grpo_takes_the_samplers_log_probs_as_old_and_updates_as_with_a_pass(
        sft_run):  # noqa: F811
    sampled = make_loop(sft_run)  # 4 prompts x G=4 in minibatches of 8: the second is scored after a step
    batch = sampled.rollout(0)
    assert sampled.clock.metrics()["time/scoring_old"] == 0.0 and batch.sampler_logprobs is None
    forced = make_loop(sft_run, loop_class=ForcedPasses)
    recomputed = forced.rollout(0)
    assert forced.clock.metrics()["time/scoring_old"] > 0
    assert torch.equal(batch.input_ids, recomputed.input_ids)  # the same draws
    tokens = batch.attention_mask[:, batch.prompt_width:] > 0
    difference = (batch.old_logprobs - recomputed.old_logprobs)[tokens].abs().max()
    assert 0 < difference < 1e-5  # the same log-probabilities but for fp32 rounding (a cached, merged decode)
    assert (batch.old_logprobs[~tokens] == 0).all()
    first = sampled.minibatch(batch, torch.arange(8), sampled.advantages(batch))
    assert abs(first["ratio/mean"] - 1.0) < 1e-5 and first["skipped"] == 0
    before = lora_state(make_loop(sft_run))
    again = make_loop(sft_run)
    again_metrics = again.run_step(0)
    forced = make_loop(sft_run, loop_class=ForcedPasses)
    forced_metrics = forced.run_step(0)
    assert again_metrics["time/scoring_old"] == 0.0 and forced_metrics["time/scoring_old"] > 0
    ours = lora_state(again)
    theirs = lora_state(forced)
    moved = max(float((theirs[name] - before[name]).abs().max()) for name in theirs)
    apart = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    assert moved > 0 and apart < 1e-3 * moved  # four steps each: the updates agree to fp32 rounding
    assert abs(again_metrics["kl"] - forced_metrics["kl"]) < 1e-4


@pytest.mark.parametrize("change", ["recompute", "bf16", "llama_cpp"])
def test_the_old_pass_runs_when_asked_under_bf16_and_for_another_engines_samples(sft_run, change):  # noqa: F811
    assert make_loop(sft_run).old_from_sampler()  # the default: PyTorch samples in fp32
    loop = make_loop(sft_run, old_logprobs="recompute" if change == "recompute" else "sampler")
    if change == "bf16":
        loop.precision = "bf16"
    if change == "llama_cpp":
        loop.sampler = object()  # any sampler other than PyTorch's: its log-probs are another engine's
    assert not loop.old_from_sampler()
    if change == "recompute":
        assert loop.run_step(0)["time/scoring_old"] > 0
