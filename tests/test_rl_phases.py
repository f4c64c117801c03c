"""Where an RL iteration's time goes, and the passes it skips: the phases are logged with every iteration, and
GRPO's reference and old-log-probability passes run only when something uses them, without changing the update."""

import pytest
import torch

from slm_align.config import WatchdogSettings
from slm_align.rl import phases
from slm_align.rl.grpo import GRPO
from slm_align.rl.phases import PHASES, PhaseClock
from slm_align.rl.recovery import WatchedRun
from slm_align.rl.watchdog import Watchdog
from tests.test_rl import lora_state, make_loop, sft_run  # noqa: F401  (sft_run: the shared fixture)


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
    assert clock.metrics() == {"time/sampling": 2.0, "time/reward": 0.0, "time/scoring_old": 0.0,
                               "time/scoring_ref": 0.0, "time/update_forward": 0.0, "time/update_backward": 1.0}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_every_iteration_logs_its_phases_and_they_fit_in_the_iteration(sft_run, algo):  # noqa: F811
    loop = make_loop(sft_run, algo=algo)
    for step in range(2):
        metrics = loop.run_step(step)
        timed = [metrics[f"time/{name}"] for name in PHASES]
        assert all(seconds > 0 for seconds in timed)  # every phase ran (beta > 0, two epochs: both passes)
        assert sum(timed) <= metrics["step_time"]


def flat_probe() -> list[float]:
    """A watchdog probe that always scores 0."""
    return [0.0]


class ForcedPasses(GRPO):
    """GRPO that scores old and reference log-probabilities in passes of their own whether or not they are used."""

    def needs_old_pass(self) -> bool:
        return True

    def needs_reference(self) -> bool:
        return True


def test_no_reference_pass_at_beta_zero_unless_the_watchdog_reads_the_kl(sft_run, tmp_path):  # noqa: F811
    skipping = make_loop(sft_run, grpo={"beta": 0.0})
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
    batch, _ = watched.rollout(0)
    assert batch.ref_logprobs is not None  # the KL-runaway detector gets its metric


def test_a_single_update_takes_its_old_logprobs_from_its_own_forward_so_the_first_ratio_is_exactly_one(
        sft_run):  # noqa: F811
    one_step = dict(epochs=1, minibatch_size=16)  # 4 prompts x G=4: all 16 samples in one optimizer step
    skipping = make_loop(sft_run, **one_step)
    batch, _ = skipping.rollout(0)
    assert batch.old_logprobs is None and skipping.clock.metrics()["time/scoring_old"] == 0.0
    result = skipping.minibatch(batch, torch.randperm(16), skipping.loss(batch, skipping.advantages(batch)))
    assert result["ratio/mean"] == 1.0 and result["ratio/max"] == 1.0 and result["skipped"] == 0
    assert batch.old_logprobs is not None and batch.old_logprobs.shape == batch.mask.shape  # kept for the KL
    forced = make_loop(sft_run, loop_class=ForcedPasses, **one_step)
    again = make_loop(sft_run, **one_step)
    again.run_step(0)
    forced.run_step(0)
    ours = lora_state(again)
    for name, value in lora_state(forced).items():
        assert torch.allclose(ours[name], value, rtol=0, atol=1e-7)  # the same step as with a pass of its own
    assert make_loop(sft_run).rollout(0)[0].old_logprobs is not None  # two epochs: the pass runs
