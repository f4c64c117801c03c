"""The envelope's runtime guards: exact snapshots for rollback, finiteness checks, counters."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from slm_align.errors import UserError


class TrainingDiverged(UserError):
    """Too many consecutive rollbacks: the run stops with the reason instead of training on garbage."""


class Snapshot:
    """Trainable parameters and optimizer state, copied so that :meth:`restore` puts them back bit for bit."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params = params
        self.optimizer = optimizer
        self.values = [p.detach().clone() for p in params]
        self.state = copy.deepcopy(optimizer.state_dict())

    def restore(self) -> None:
        with torch.no_grad():
            for param, value in zip(self.params, self.values):
                param.copy_(value)
                param.grad = None
        self.optimizer.load_state_dict(copy.deepcopy(self.state))


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


@dataclass
class GuardCounters:
    """What the guards did: skipped minibatches, rollbacks (total and in a row), clipped values."""

    skipped: int = 0
    rollbacks: int = 0
    consecutive_rollbacks: int = 0
    score_clipped: int = 0
    advantage_clipped: int = 0

    def rolled_back(self, limit: int, reason: str) -> None:
        self.rollbacks += 1
        self.consecutive_rollbacks += 1
        if self.consecutive_rollbacks >= limit:
            raise TrainingDiverged(f"RL stopped after {self.consecutive_rollbacks} consecutive rollbacks (last: "
                                   f"{reason}); lower the learning rate, check the reward for NaN/inf, or resume "
                                   "from the last checkpoint")
