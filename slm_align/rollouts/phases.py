"""Where an RL iteration's time goes: wall-clock seconds per named phase, logged
with the iteration's metrics.

The phases PPO and GRPO time (each a ``time/<phase>`` metric, seconds, summed over
every entry in the iteration):

- ``sampler_sync``: with llama.cpp as the sampler, writing the current LoRA as an adapter GGUF and
  swapping it in (0 with PyTorch's sampler);
- ``sampling``: generating the completions (generation.py's decoding loop with the KV
  cache, the LoRA merged in; or llama.cpp's);
- ``reward``: the reward function on the decoded completions;
- ``scoring_old``: the old log-probabilities (and PPO's values) of the samples, when
  computed in their own pass;
- ``scoring_ref``: the reference log-probabilities (the adapter disabled),
  skipped when nothing uses them;
- ``update_forward``: each minibatch's snapshot, forward pass, ratio and loss;
- ``update_backward``: each minibatch's backward, gradient checks, clip and optimizer step.

The phases do not overlap, so their sum is at most the iteration's ``step_time`` (the rest is
bookkeeping: advantages, metrics, Python).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("sampler_sync", "sampling", "reward", "scoring_old", "scoring_ref", "update_forward", "update_backward")
"""Every phase an iteration reports, in the order they run."""


class PhaseClock:
    """Seconds spent in each named phase since the clock was made
    (``time.perf_counter``, wall clock)."""

    def __init__(self):
        self.seconds = {name: 0.0 for name in PHASES}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the ``with`` block to phase ``name`` (exceptions included)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` for every phase, zero for those that did not run."""
        return {f"time/{name}": seconds for name, seconds in self.seconds.items()}
