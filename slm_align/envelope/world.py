"""Data parallel over processes started by ``accelerate launch`` or ``torchrun``: NCCL between GPUs
(one per process, by LOCAL_RANK), gloo between CPU processes. RL's own loop uses it directly; the
Trainer stages set the process group up through it (the Trainer takes it over) so that rank 0 alone
prepares and publishes their folders.

Each rank samples its own share of the prompts; gradients are averaged across ranks before
every optimizer step, and every guard decision (skip, rollback) is taken on world-wide figures,
so all replicas stay identical.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slm_align.errors import UserError


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes (1 when not launched distributed)."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"
    """Where the tensors of collectives live: this rank's GPU under NCCL, the CPU under gloo."""

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes artifacts and logs."""
        return self.rank == 0

    def _dist(self):
        import torch.distributed as dist

        return dist

    def average_(self, tensors) -> None:
        """Average tensors across ranks in place (one flat all-reduce)."""
        if self.size == 1:
            return
        tensors = [t for t in tensors if t is not None]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._dist().all_reduce(flat)
        flat /= self.size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def mean(self, value: float) -> float:
        """The mean of ``value`` over ranks (float64 all-reduce); ``value``
        itself in one process."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        self._dist().all_reduce(tensor)
        return float(tensor) / self.size

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one."""
        return self.mean(1.0 if flag else 0.0) > 0

    def all(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on all of them."""
        return self.mean(1.0 if flag else 0.0) == 1.0

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.size > 1:
            self._dist().barrier()

    def share(self, value):
        """Rank 0's ``value`` on every rank."""
        if self.size == 1:
            return value
        box = [value]
        self._dist().broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, work: Callable[[], Any]) -> Any:
        """``work()`` on rank 0 alone (preparing a stage's folder, the gate), its result
        shared with every rank; a
        :class:`UserError` it raises is raised on every rank, so all of them stop with the same one line."""
        outcome = None
        if self.main:
            try:
                outcome = work()
            except UserError as exc:
                outcome = exc
        outcome = self.share(outcome)
        if isinstance(outcome, UserError):
            raise outcome
        return outcome

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.size == 1:
            return [value]
        out = [None] * self.size
        self._dist().all_gather_object(out, value)
        return out


def launched() -> bool:
    """Whether ``accelerate launch``/``torchrun`` started this process as one of
    several (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_device(device: str) -> str:
    """The device this process computes on: under a launcher with CUDA, the GPU of its
    LOCAL_RANK; else ``device``."""
    if launched() and device.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def world_from_env(device: str = "cpu") -> World:
    """The world that ``accelerate launch``/``torchrun`` set up through WORLD_SIZE and RANK: NCCL
    when this rank computes on a GPU (``device`` from :func:`rank_device`), gloo otherwise."""
    if not launched():
        return World()
    import torch.distributed as dist

    collective = "cpu"
    if device.startswith("cuda"):
        collective = device
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if collective != "cpu" else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=collective)


def replica_digest(params) -> str:
    """sha256 of parameter bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
