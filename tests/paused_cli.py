"""Run ``slm-align`` in a child process that stops at a recorded point and waits there to be killed.

The crash tests SIGKILL a run at that point. The run itself reaches it (a checkpoint saved, the
n-th metrics line written, the artifact written in scratch) and writes a marker file before it
waits, so the test neither polls a window a loaded machine can miss nor sees the run finish first.

Usage: ``python -m tests.paused_cli MARKER POINT ARGS...`` with POINT one of ``trainer-start``
(a Trainer stage's work dir exists, no checkpoint yet), ``trainer-checkpoint:N`` (a Trainer
checkpoint at step N or later was saved), ``metrics-line:N`` (an RL or preference loop wrote its
N-th metrics line) and ``gguf-written`` (an export's GGUF is written, not yet verified or published).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path


def wait_for_kill(marker: Path) -> None:
    """Say the point was reached, then never return."""
    marker.write_text("reached\n")
    while True:
        time.sleep(60)


def pause_at_trainer_start(marker: Path, _: int) -> None:
    from transformers import Trainer

    def train(self, *args, **kwargs):
        wait_for_kill(marker)

    Trainer.train = train


def pause_after_trainer_checkpoint(marker: Path, step: int) -> None:
    from transformers import Trainer

    saved = Trainer._save_checkpoint

    @functools.wraps(saved)
    def save(self, model, trial):
        saved(self, model, trial)
        if self.state.global_step >= step:
            wait_for_kill(marker)

    Trainer._save_checkpoint = save


def pause_after_metrics_line(marker: Path, lines: int) -> None:
    from slm_align.envelope import loop

    append = loop.append_metrics

    @functools.wraps(append)
    def appended(path, metrics):
        append(path, metrics)
        if Path(path).read_text().count("\n") >= lines:
            wait_for_kill(marker)

    loop.append_metrics = appended


def pause_after_gguf_written(marker: Path, _: int) -> None:
    from slm_align.export.targets import gguf

    write = gguf.write_gguf

    @functools.wraps(write)
    def written(*args, **kwargs):
        result = write(*args, **kwargs)
        wait_for_kill(marker)
        return result

    gguf.write_gguf = written


POINTS = {"trainer-start": pause_at_trainer_start, "trainer-checkpoint": pause_after_trainer_checkpoint,
          "metrics-line": pause_after_metrics_line, "gguf-written": pause_after_gguf_written}


def main() -> None:
    marker, point, *args = sys.argv[1:]
    name, _, count = point.partition(":")
    POINTS[name](Path(marker), int(count or 0))
    from slm_align.cli import main as cli

    sys.argv = ["slm-align", *args]
    cli()


if __name__ == "__main__":
    main()
