"""The envelope's runtime guards: exact snapshots for rollback, finiteness checks, counters."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from slm_align.errors import UserError


class TrainingDiverged(UserError):
    """Too many consecutive rollbacks: the run stops with the reason instead of training on garbage."""


class Snapshot:
    """Trainable parameters and optimizer state, copied so that :meth:`restore` puts them back bit for bit.

    Plain tensor clones (no deepcopy machinery): the snapshot is taken before every minibatch, so it must be cheap.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params = params
        self.optimizer = optimizer
        self.values = [p.detach().clone() for p in params]
        self.state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in st.items()}
                      for p, st in optimizer.state.items()}

    def restore(self) -> None:
        """Put parameters and optimizer state back as they were; drop gradients and any state created since."""
        with torch.no_grad():
            for param, value in zip(self.params, self.values):
                param.copy_(value)
                param.grad = None
            for param in list(self.optimizer.state):
                if param not in self.state:  # state created by the failed step: the optimizer never had it
                    del self.optimizer.state[param]
            for param, saved in self.state.items():
                current = self.optimizer.state[param]
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and isinstance(current.get(key), torch.Tensor):
                        current[key].copy_(value)
                    else:
                        current[key] = copy.copy(value)


def all_finite(tensors) -> bool:
    """One check over many tensors: a NaN or inf anywhere makes the sum of sums non-finite."""
    sums = [t.detach().float().sum() for t in tensors if t is not None]
    return bool(torch.isfinite(torch.stack(sums).sum())) if sums else True


@dataclass
class GuardCounters:
    """What the guards did: skipped minibatches, rollbacks (total and in a row), clipped values."""

    skipped: int = 0
    rollbacks: int = 0
    consecutive_rollbacks: int = 0
    score_clipped: int = 0
    advantage_clipped: int = 0

    def rolled_back(self, limit: int, reason: str) -> None:
        """Count a rollback; stop the run (:class:`TrainingDiverged`) at ``limit`` in a row."""
        self.rollbacks += 1
        self.consecutive_rollbacks += 1
        if self.consecutive_rollbacks >= limit:
            raise TrainingDiverged(f"RL stopped after {self.consecutive_rollbacks} consecutive rollbacks (last: "
                                   f"{reason}); lower the learning rate, check the reward for NaN/inf, or resume "
                                   "from the last checkpoint")
