"""The guarded optimizer step: the gradient-norm clip scales the step to the bound and reports the norm before
clipping; a clip of 0 leaves the gradient as it is."""

import pytest
import torch

from slm_align.config.rl import EnvelopeSettings
from slm_align.envelope.guard import GuardCounters, GuardedOptimizer
from slm_align.envelope.world import World

GRADIENT = torch.tensor([30.0, 40.0, 0.0])
"""d loss / d p for loss = GRADIENT . p: norm 50."""


def stepped(grad_clip: float) -> tuple[torch.Tensor, dict]:
    """One SGD step (learning rate 1) from zero on ``GRADIENT . p``: the new parameter and the step's figures."""
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p], lr=1.0)
    guard = GuardedOptimizer([p], optimizer, EnvelopeSettings(grad_clip=grad_clip), World(), GuardCounters())
    figures = guard.step((GRADIENT * p).sum(), guard.snapshot())
    return p.detach(), figures


def test_the_gradient_norm_clip_scales_the_step_to_its_bound():
    clipped, figures = stepped(grad_clip=1.0)
    assert torch.allclose(clipped, -GRADIENT / 50.0)  # the direction kept, the length cut to 1
    assert figures["grad_norm"] == pytest.approx(50.0)  # the norm reported is the one before clipping
    assert float(clipped.norm()) == pytest.approx(1.0)


def test_a_clip_of_zero_is_off_and_a_bound_above_the_norm_changes_nothing():
    unclipped, figures = stepped(grad_clip=0.0)
    assert torch.equal(unclipped, -GRADIENT) and figures["grad_norm"] == pytest.approx(50.0)
    loose, _ = stepped(grad_clip=100.0)
    assert torch.equal(loose, -GRADIENT)
