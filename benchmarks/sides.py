"""Ours against another tool, side by side: each side in its own subprocess (so peak memory is
its own), runs alternating (so a noisy neighbour slows both alike), medians reported. Used by
the *_vs_trl benchmarks."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Callable

SIDES = ("ours", "trl")


def alternate_sides(script: str, argv: list[str], repeats: int,
                    sides: tuple[str, ...] = SIDES, together: bool = False) -> dict[str, list[dict]]:
    """Run ``script --side S argv`` ``repeats`` times for each of ``sides``, alternating (``together``:
    the sides of a round at the same time, each its own process, so that a busy host's load falls on
    all alike; compare their CPU seconds then); each run's last stdout line is its JSON result. A
    failing side stops the benchmark with its last error line."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(repeats):
        rounds = [sides] if together else [(side,) for side in sides]
        for group in rounds:
            started = {side: subprocess.Popen([sys.executable, script, "--side", side] + argv,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for side in group}
            for side, process in started.items():
                out, err = process.communicate()
                if process.returncode != 0:
                    sys.exit(f"{side} failed: {err.strip().splitlines()[-1]}")
                runs[side].append(json.loads(out.strip().splitlines()[-1]))
    return runs


def medians(runs: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """``{side: {key: median over its runs}}``."""
    return {side: {key: statistics.median(run[key] for run in runs[side]) for key in keys} for side in runs}


def print_rows(medians_by_side: dict[str, dict[str, float]], rows: tuple[tuple[str, str, str], ...]) -> None:
    """One line per ``(key, label, format)``: ours, TRL's, and their ratio (a
    dash when TRL's is zero)."""
    print(f"{'':30}{'slm-align':>12}{'TRL':>12}{'ratio':>10}")
    for key, label, form in rows:
        ours = medians_by_side["ours"][key]
        trl = medians_by_side["trl"][key]
        ratio = f"{ours / trl:10.2f}" if trl else f"{'-':>10}"
        print(f"{label:30}{ours:12{form}}{trl:12{form}}{ratio}")


def add_side_arguments(parser: argparse.ArgumentParser, sides: tuple[str, ...] = SIDES) -> None:
    """``--repeats`` (runs per side) and the hidden ``--side`` a child process runs as (one of ``sides``)."""
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating; "
                        "medians are reported")
    parser.add_argument("--side", choices=sides, help=argparse.SUPPRESS)


def ran_as_side(args, run_ours: Callable, run_trl: Callable) -> bool:
    """In a child process (``--side``): run that side, print its JSON result, and say so."""
    if args.side is None:
        return False
    runner = run_ours
    if args.side == "trl":
        runner = run_trl
    print(json.dumps(runner(args)))
    return True


def timed_mean(boundaries: list[float]) -> float:
    """Mean length of the intervals between iteration boundaries, the first
    (warm-up) interval left out."""
    per_iteration = [b - a for a, b in zip(boundaries, boundaries[1:])]
    return sum(per_iteration[1:]) / max(1, len(per_iteration) - 1)


class StepStamps:
    """The TRL side's clock: wall and CPU time at the end of every optimizer step of a transformers
    Trainer, from :meth:`start`; :meth:`per_iteration` turns them into seconds per iteration."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.started = (0.0, 0.0)

    def callback(self):
        """A TrainerCallback that stamps this clock at the end of every step."""
        from transformers import TrainerCallback

        clock = self

        class Stamp(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                clock.wall.append(time.perf_counter())
                clock.cpu.append(time.process_time())

        return Stamp()

    def start(self) -> None:
        self.started = (time.perf_counter(), time.process_time())

    def per_iteration(self, updates: int) -> tuple[float, float]:
        """(wall, CPU) seconds per iteration of ``updates`` optimizer steps, the first iteration (warm-up)
        left out."""
        return (timed_mean([self.started[0]] + self.wall[updates - 1::updates]),
                timed_mean([self.started[1]] + self.cpu[updates - 1::updates]))
