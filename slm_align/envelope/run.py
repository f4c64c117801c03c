"""What every run that trains the policy's fresh adapter inside the envelope holds: PPO/GRPO
(rl/learner.py Learner) and DPO/KTO (preference/learner.py PreferenceLearner) both build on it.

The policy on its device, the precision of its forward passes, gradient checkpointing, the trainable
parameters, AdamW (learning rate scaled to the model's size when unset), the guarded optimizer step,
the step count, and the part of a checkpoint they all write.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from slm_align.config import EnvelopeSettings
from slm_align.envelope.guard import GuardCounters, GuardedOptimizer, load_trainable_state, trainable_state
from slm_align.envelope.learning_rate import base_parameters, default_learning_rate, warmup_factor
from slm_align.envelope.policy import checkpoint_in_eval, enable_checkpointing
from slm_align.envelope.world import World
from slm_align.modeling.accelerator import device_of, forward_autocast


@dataclass(frozen=True)
class Placement:
    """Where a run's passes run and how: its ranks, the precision of its forwards, checkpointing."""

    world: World = World()
    """The data-parallel ranks (one process unless launched)."""
    precision: str = "fp32"
    """Autocast of the forward passes ("fp32": none); the loss math is fp32 either way."""
    checkpointing: bool = False
    """Gradient checkpointing: the layers' activations recomputed in backward, not kept."""


class TrainableRun:
    """The policy, its trainable parameters, AdamW and the guarded optimizer step;
    subclasses add their algorithm."""

    def __init__(self, policy, named_params: list[tuple[str, torch.nn.Parameter]],
                 learning_rate: Optional[float], envelope: EnvelopeSettings, placement: Placement):
        self.policy = policy
        self.device = device_of(policy)
        self.precision = placement.precision
        self.checkpointing = placement.checkpointing
        if placement.checkpointing:
            enable_checkpointing(policy)
        self.envelope = envelope
        self.world = placement.world
        self.named_params = named_params
        self.params = [p for _, p in named_params]
        self.learning_rate = learning_rate
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(base_parameters(policy))
        self.optimizer = torch.optim.AdamW(self.params, lr=self.learning_rate, weight_decay=0.0)
        self.guard = GuardedOptimizer(self.params, self.optimizer, envelope, self.world,
                                      GuardCounters())
        self.step = 0
        self.lr_scale = 1.0
        """The watchdog's multiplier of the learning rate (1 until a recovery lowers it)."""
        self.warmup_steps = 0
        """Iterations of linear learning-rate warmup (:func:`warmup_factor`; 0: none)."""

    def set_learning_rate(self) -> None:
        """AdamW's rate for this iteration's updates: the base rate times the watchdog's scale times
        the warmup's share at ``step``."""
        rate = self.learning_rate * self.lr_scale * warmup_factor(self.step, self.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = rate

    @property
    def counters(self) -> GuardCounters:
        """What the guards did so far (the guarded optimizer's counters)."""
        return self.guard.counters

    @counters.setter
    def counters(self, value: GuardCounters) -> None:
        self.guard.counters = value

    def forward_context(self):
        """Autocast of this run's forward passes on the policy's device (none at fp32);
        the loss math is fp32."""
        return forward_autocast(self.device, self.precision)

    def prepare_forward(self) -> None:
        """Dropout off in every training forward (the first ratio is exactly 1, and a DPO
        policy at step 0 equals its reference), with the layers still recomputed under
        gradient checkpointing."""
        self.policy.eval()
        if self.checkpointing:
            checkpoint_in_eval(self.policy)

    def after_backward(self) -> None:
        """Hook between backward and the optimizer step (fault-injection tests override it)."""

    def run_state(self) -> dict:
        """The checkpoint's shared part: trainable weights, AdamW, torch's RNG, the step
        and the guards' counters."""
        state = trainable_state(self.named_params, self.optimizer)
        return dict(state, step=self.step, counters=asdict(self.counters))

    def load_run_state(self, state: dict) -> None:
        """Put a :meth:`run_state` back."""
        load_trainable_state(self.named_params, self.optimizer, state)
        self.step = state["step"]
        self.counters = GuardCounters(**state["counters"])
