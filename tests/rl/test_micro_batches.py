"""RL's update in micro-batches (``rl.micro_batch_size``): the losses of a minibatch's micro-batches,
each normalised by the whole minibatch, add up to its loss, so the accumulated step is the step of one
forward over all rows; the guards hold as before."""

import pytest
import torch

from slm_align.errors import UserError
from slm_align.rl.advantages import masked_mean
from slm_align.rl.grpo import GRPO
from slm_align.rl.learner import merged_stats
from slm_align.rl.losses import Whole, aggregate, clipped_value_loss
from tests.helpers import finished_sft_run
from tests.rl.test_guards import lora_state, make_loop, optimizer_state, prepared, same_state

PARTS = (slice(0, 1), slice(1, 3), slice(3, 5))
"""Three micro-batches of unequal sizes over five rows."""


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("micro") / "run", tiny_models["llama"], stories, steps=2)


def ragged():
    """(5, 4) per-token values and a mask of unequal lengths (one row with no trained token)."""
    generator = torch.Generator().manual_seed(0)
    per_token = torch.randn(5, 4, generator=generator)
    lengths = torch.tensor([4, 1, 3, 0, 2])
    mask = (torch.arange(4) < lengths.unsqueeze(-1)).float()
    return per_token, mask


@pytest.mark.parametrize("loss_type", ["token_mean", "grpo", "dr_grpo"])
def test_micro_batch_losses_add_up_to_the_minibatch_loss(loss_type):
    per_token, mask = ragged()
    whole = Whole.of(mask)
    summed = sum(aggregate(per_token[part], mask[part], loss_type, 4, whole) for part in PARTS)
    assert summed.item() == pytest.approx(aggregate(per_token, mask, loss_type, 4).item())
    own = sum(aggregate(per_token[part], mask[part], loss_type, 4) for part in PARTS)
    assert own.item() != pytest.approx(summed.item())  # each part normalised by itself is another loss


def test_value_loss_of_micro_batches_adds_up_too():
    values, mask = ragged()
    returns = values.flip(0)
    whole = Whole.of(mask)
    summed = sum(clipped_value_loss(values[part], values[part] * 0, returns[part], mask[part], 0.2, whole)
                 for part in PARTS)
    assert summed.item() == pytest.approx(clipped_value_loss(values, values * 0, returns, mask, 0.2).item())


def test_merged_statistics_are_those_of_the_whole_minibatch():
    per_token, mask = ragged()
    whole = Whole.of(mask)
    parts = []
    for part in PARTS:
        figures = {"ratio/mean": float(masked_mean(per_token[part], mask[part])),
                   "ratio/max": float(per_token[part].max()),
                   "loss/policy": float(aggregate(per_token[part], mask[part], "token_mean", 4, whole))}
        parts.append((figures, float(mask[part].sum())))
    merged = merged_stats(parts)
    assert merged["ratio/mean"] == pytest.approx(float(masked_mean(per_token, mask)))
    assert merged["ratio/max"] == pytest.approx(float(per_token.max()))
    assert merged["loss/policy"] == pytest.approx(float(aggregate(per_token, mask, "token_mean", 4)))


def trained(sft_run, micro, **rl):
    """A loop after one iteration with ``micro_batch_size`` = ``micro``: its trainable state and metrics."""
    loop = make_loop(sft_run, micro_batch_size=micro, **rl)
    metrics = loop.run_step(0)
    return loop, metrics


def assert_same_step(one, micro):
    (loop_a, metrics_a), (loop_b, metrics_b) = one, micro
    a, b = lora_state(loop_a), lora_state(loop_b)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6), name
    for key in ("loss/policy", "ratio/mean", "entropy", "clip_frac", "grad_norm", "reward/mean", "kl"):
        assert metrics_close(metrics_a[key], metrics_b[key]), key


@pytest.mark.parametrize("minibatch", [8, 16])
def test_grpo_in_micro_batches_takes_the_same_steps(sft_run, minibatch):
    """8: two minibatches an epoch (old log-probabilities from their own pass); 16: one, whose
    first forward writes the old log-probabilities micro-batch by micro-batch."""
    one = trained(sft_run, None, minibatch_size=minibatch)
    micro = trained(sft_run, 3, minibatch_size=minibatch)
    assert_same_step(one, micro)
    before = lora_state(make_loop(sft_run))
    assert any(not torch.equal(before[name], lora_state(one[0])[name]) for name in before)  # it trained
    assert one[1]["kl"] is not None  # the old log-probabilities of every row (written micro-batch by
    # micro-batch with 16) against the reference's: "kl" above compares them


def test_ppo_in_micro_batches_takes_the_same_steps(sft_run):
    one = trained(sft_run, None, algo="ppo")
    micro = trained(sft_run, 3, algo="ppo")
    assert_same_step(one, micro)
    assert metrics_close(one[1]["loss/value"], micro[1]["loss/value"])
    head_a = dict(one[0].value_head.named_parameters())
    head_b = dict(micro[0].value_head.named_parameters())
    assert all(torch.allclose(head_a[n], head_b[n], rtol=1e-4, atol=1e-6) for n in head_a)


def metrics_close(a: float, b: float) -> bool:
    return b == pytest.approx(a, rel=1e-4, abs=1e-6)


def test_a_tripped_ratio_guard_leaves_no_gradient_and_no_step(sft_run):
    loop = make_loop(sft_run, micro_batch_size=3)
    batch, adv, rows = prepared(loop)
    loop.minibatch(batch, rows, adv)
    params, state = lora_state(loop), optimizer_state(loop)
    batch.old_logprobs = batch.old_logprobs - 3.0  # forces the ratio to e^3 ~ 20 > 5
    result = loop.minibatch(batch, rows, adv)
    assert result["skipped"] == 1 and result["ratio/mean"] > 5
    assert same_state(lora_state(loop), params) and same_state(optimizer_state(loop), state)
    assert all(p.grad is None for p in loop.params)  # the micro-batches' backward was dropped


class NaNSecondMicroBatch(GRPO):
    """GRPO whose second micro-batch's loss is not finite."""

    calls = 0

    def loss(self, batch, adv, fwd, whole):
        loss, stats = super().loss(batch, adv, fwd, whole)
        self.calls += 1
        return (loss * float("nan") if self.calls == 2 else loss), stats


def test_a_non_finite_micro_batch_rolls_back_and_forgets_half_written_old_logprobs(sft_run):
    loop = make_loop(sft_run, loop_class=NaNSecondMicroBatch, micro_batch_size=5, minibatch_size=16)
    batch = loop.rollout(0)
    adv = loop.advantages(batch)
    assert batch.old_logprobs is None  # one minibatch an epoch: its first forward writes them
    params, state = lora_state(loop), optimizer_state(loop)
    result = loop.minibatch(batch, torch.arange(16), adv)
    assert result["rolled_back"] == 1 and loop.counters.rollbacks == 1
    assert same_state(lora_state(loop), params) and same_state(optimizer_state(loop), state)
    assert batch.old_logprobs is None  # rows 5-15 were never written: the next minibatch writes them all
    result = loop.minibatch(batch, torch.arange(16), adv)
    assert "loss" in result and batch.old_logprobs is not None
    assert not same_state(lora_state(loop), params)


class ShortOfMemory(GRPO):
    """GRPO whose forward of more than ``fits`` rows at once runs out of memory."""

    fits = 2

    def loss(self, batch, adv, fwd, whole):
        if fwd.rows.numel() > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().loss(batch, adv, fwd, whole)


def test_out_of_memory_halves_the_micro_batches_and_takes_the_same_step(sft_run, capsys):
    plain = make_loop(sft_run)
    batch, adv, rows = prepared(plain)
    expected = plain.minibatch(batch, rows, adv)
    short = make_loop(sft_run, loop_class=ShortOfMemory)
    batch, adv, rows = prepared(short)
    result = short.minibatch(batch, rows, adv)
    assert short.settings.micro_batch_size == 2  # 8 rows, then 4, then 2
    assert metrics_close(expected["loss"], result["loss"]) and metrics_close(expected["grad_norm"], result["grad_norm"])
    after, reference = lora_state(short), lora_state(plain)
    assert all(torch.allclose(after[n], reference[n], rtol=1e-4, atol=1e-6) for n in after)
    said = capsys.readouterr().err
    assert "out of memory with 8 rows at a time; now 4" in said and "now 2 (--micro-batch-size 2" in said


def test_out_of_memory_at_one_row_stops_with_the_remedies_and_nothing_moved(sft_run):
    short = make_loop(sft_run, loop_class=ShortOfMemory, minibatch_size=16)
    short.fits = 0
    batch = short.rollout(0)
    adv = short.advantages(batch)
    params, state = lora_state(short), optimizer_state(short)
    with pytest.raises(UserError, match="out of memory with one row at a time; use --gradient-checkpointing"):
        short.minibatch(batch, torch.arange(16), adv)
    assert same_state(lora_state(short), params) and same_state(optimizer_state(short), state)
    assert batch.old_logprobs is None
