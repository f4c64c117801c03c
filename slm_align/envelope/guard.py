"""The envelope's runtime guards: exact snapshots for rollback, finiteness checks, counters."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from slm_align.errors import UserError


class TrainingDiverged(UserError):
    """Too many consecutive rollbacks: the run stops with the reason instead
    of training on garbage."""


class Snapshot:
    """Trainable parameters and optimizer state, copied so that :meth:`restore`
    puts them back bit for bit.

    Plain tensor clones (no deepcopy machinery): the snapshot is taken before every
    minibatch, so it must be cheap.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params = params
        self.optimizer = optimizer
        self.values = [p.detach().clone() for p in params]
        self.state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in st.items()}
                      for p, st in optimizer.state.items()}

    def restore(self) -> None:
        """Put parameters and optimizer state back as they were; drop gradients and
        any state created since."""
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


def trainable_state(named_params: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer) -> dict:
    """What a resumed run needs to continue bit for bit: trainable weights,
    optimizer state, torch's RNG."""
    return {"params": {name: param.detach().clone() for name, param in named_params},
            "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}


def load_trainable_state(named_params: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                         state: dict) -> None:
    """Put a :func:`trainable_state` back."""
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(state["params"][name])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])


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
            raise TrainingDiverged(f"training stopped after {self.consecutive_rollbacks} consecutive rollbacks (last: "
                                   f"{reason}); lower the learning rate, check the reward for NaN/inf, or resume "
                                   "from the last checkpoint")


class GuardedOptimizer:
    """The envelope around one optimizer step, shared by RL and preference optimisation.

    :meth:`step` takes a loss already computed: a finite loss, backward, the ``after_backward`` hook, gradient
    averaging across data-parallel ranks, a finite gradient, the gradient-norm clip, the optimizer
    step, finite parameters. Any non-finite value restores the :meth:`snapshot` taken before the
    forward pass bit for bit and is counted; ``max_consecutive_rollbacks`` in a row stop the run
    (:class:`TrainingDiverged`). A step over micro-batches (gradient accumulation) calls the same
    pieces itself: :meth:`begin`, :meth:`backward` per micro-batch, then :meth:`finish`.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, envelope, world,
                 counters: GuardCounters):
        self.params = params
        self.optimizer = optimizer
        self.envelope = envelope
        self.world = world
        self.counters = counters

    def snapshot(self) -> Optional[Snapshot]:
        """Parameters and optimizer state before the step (None with rollback off)."""
        if not self.envelope.rollback:
            return None
        return Snapshot(self.params, self.optimizer)

    def step(self, loss: torch.Tensor, snapshot: Optional[Snapshot], after_backward=None) -> dict:
        """Backward and one optimizer step on ``loss``: ``{"loss", "grad_norm"}``, or
        ``{"rolled_back": 1}``."""
        self.begin()
        if not self.backward(loss):
            return self.roll_back(snapshot, "non-finite loss")
        return self.finish(float(loss.detach()), snapshot, after_backward)

    def begin(self) -> None:
        """No gradient yet: before a step's first backward (and to drop gradients a skipped step
        accumulated)."""
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> bool:
        """Backward of one (micro-batch's) loss, its gradients added to those already there; False,
        with no backward, when the loss is not finite on some rank and rollback is on (the caller
        rolls back)."""
        if self.envelope.rollback and self.world.any(not all_finite([loss])):
            return False
        loss.backward()
        return True

    def finish(self, loss: float, snapshot: Optional[Snapshot], after_backward=None) -> dict:
        """The step on the gradients accumulated since :meth:`begin` (``loss``: their loss, for
        the record): the hook, averaging over ranks, a finite gradient, the clip, the optimizer
        step, finite parameters."""
        guarded = self.envelope.rollback
        if after_backward is not None:
            after_backward()
        self.world.average_([p.grad for p in self.params])  # data parallel: every replica takes the same step
        if guarded and not all_finite([p.grad for p in self.params]):
            return self.roll_back(snapshot, "non-finite gradient")
        max_norm = self.envelope.grad_clip if self.envelope.grad_clip else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        self.optimizer.step()
        if guarded and not all_finite(self.params):
            return dict(self.roll_back(snapshot, "non-finite parameter"), grad_norm=grad_norm)
        self.counters.consecutive_rollbacks = 0
        return {"loss": loss, "grad_norm": grad_norm}

    def roll_back(self, snapshot: Snapshot, reason: str) -> dict:
        """The snapshot back, counted (a run stops after too many in a row)."""
        snapshot.restore()
        self.counters.rolled_back(self.envelope.max_consecutive_rollbacks, reason)
        return {"rolled_back": 1}
