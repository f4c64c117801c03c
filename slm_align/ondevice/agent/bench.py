"""Measure an exported model on this host: load time, time to first token, prompt and
decode speed, peak memory.

The measurement runs in a fresh Python process
(``python -m slm_align.ondevice.agent.bench ARTIFACT ...``), so the peak resident set size (VmHWM on
Linux, else ``ru_maxrss``) is the artifact's and its runtime's, not the caller's; the child also
reports the high-water mark before the model is loaded (interpreter, numpy and the runtime library)
as the baseline.

After one short warm-up run, per repeat: the prompt of exactly ``prompt_tokens`` tokens is fed to
an empty cache (prompt processing), the first token is taken greedily from its logits (time to
first token), then ``decode_tokens`` more tokens are generated one forward pass each (decode speed;
end-of-sequence is ignored, as llama-bench does). Figures are medians over the repeats.
``--save-profile`` turns the result into a user device profile (with a numpy-copy bandwidth figure
and this measurement as its reference point) that ``slm-align devices fit`` can use. Imports
neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from slm_align.errors import EXIT_USER_ERROR, UserError
from slm_align.ondevice.agent.backend import artifact_kind
from slm_align.ondevice.agent.open_artifact import open_backend
from slm_align.ondevice.devices.host import default_threads, host_facts, measure_bandwidth, peak_rss_bytes
from slm_align.ondevice.devices.measured import BenchResult, predict, profile_path, save_profile
from slm_align.ondevice.devices.profiles import load_profile
from slm_align.progress import Count, counted, stage_lines

PROMPT_TEXT = ("Once upon a time, a small robot lived in a quiet town by the sea. Every morning it "
               "walked to the harbour, counted the boats and told the children a new "
               "story about the stars. ")
RUN_DONE = "run done"  # what the measuring process writes on stdout after each measured run (its progress)


def _runtime(kind: str) -> str:
    """Import the runtime library (so the baseline includes it) and name it with its version."""
    if kind == "gguf":
        try:
            import llama_cpp
        except ImportError:
            raise UserError("GGUF artifacts need llama-cpp-python: pip "
                            "install 'slm-align[agent]'") from None
        return f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"
    try:
        import onnxruntime
    except ImportError:
        raise UserError("ONNX artifacts need onnxruntime: pip install 'slm-align[agent]'") from None
    return f"onnxruntime {onnxruntime.__version__}"


def _model_name(backend, artifact: Path) -> str:
    metadata = getattr(getattr(backend, "llm", None), "metadata", None) or {}
    return metadata.get("general.name") or (artifact.stem if artifact.is_file() else artifact.name)


def prompt_ids(backend, count: int) -> list[int]:
    """Exactly ``count`` prompt tokens: a story sentence repeated, tokenized by the
    artifact's own tokenizer."""
    first = backend.tokenize(PROMPT_TEXT)
    more = backend.tokenize(PROMPT_TEXT, add_special=False) or first
    ids = list(first)
    while len(ids) < count:
        ids.extend(more)
    return ids[:count]


def _one_run(backend, prompt: list[int], decode_tokens: int) -> tuple[float, float, float, int]:
    """(prompt seconds, time to first token, decode seconds, tokens generated) of one greedy run."""
    backend.reset()
    start = time.perf_counter()
    logits = backend.feed(prompt)
    fed = time.perf_counter()
    token = int(np.argmax(logits))
    first = time.perf_counter()
    generated = [token]
    for _ in range(decode_tokens):
        token = int(np.argmax(backend.feed([token])))
        generated.append(token)
    return fed - start, first - start, time.perf_counter() - first, len(generated)


def _nothing() -> None:
    pass


def measure(artifact, threads: int, prompt_tokens: int, decode_tokens: int, repeats: int,
            n_ctx: Optional[int] = None, on_run: Callable[[], None] = _nothing) -> BenchResult:
    """Load ``artifact`` in this process and time it; the peak RSS is this process's (see
    :func:`bench`). ``on_run`` is called after each measured run (outside its timing)."""
    artifact = Path(artifact)
    kind = artifact_kind(artifact)
    runtime = _runtime(kind)
    baseline = peak_rss_bytes()
    start = time.perf_counter()
    backend = open_backend(artifact, threads=threads, n_ctx=n_ctx)
    load_seconds = time.perf_counter() - start
    if prompt_tokens + decode_tokens > backend.n_ctx:
        raise UserError(f"--prompt-tokens {prompt_tokens} + --decode-tokens {decode_tokens} exceed "
                        f"the context window of {backend.n_ctx} tokens; lower them or raise --ctx")
    prompt = prompt_ids(backend, prompt_tokens)
    _one_run(backend, prompt, min(decode_tokens, 8))  # warm-up (caches, thread pools), not counted
    runs = []
    for _ in range(repeats):
        runs.append(_one_run(backend, prompt, decode_tokens))
        on_run()
    decode_runs = [decode_tokens / max(run[2], 1e-9) for run in runs]
    return BenchResult(
        artifact=str(artifact), kind=kind, model=_model_name(backend, artifact), runtime=runtime, threads=threads,
        n_ctx=backend.n_ctx, prompt_tokens=len(prompt), decode_tokens=decode_tokens, repeats=repeats,
        generated_tokens=runs[-1][3], load_seconds=load_seconds,
        time_to_first_token_seconds=statistics.median(run[1] for run in runs),
        prompt_tokens_per_second=statistics.median(len(prompt) / max(run[0], 1e-9) for run in runs),
        decode_tokens_per_second=statistics.median(decode_runs), decode_runs=decode_runs,
        rss_before_load_bytes=baseline, peak_rss_bytes=peak_rss_bytes(), host=host_facts())


def _check_counts(**counts: Optional[int]) -> None:
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be at least 1")


def bench(artifact, threads: Optional[int] = None, prompt_tokens: int = 128, decode_tokens: int = 64,
          repeats: int = 3, n_ctx: Optional[int] = None) -> BenchResult:
    """Measure ``artifact`` (.gguf file or ONNX export directory) on this host,
    in a fresh subprocess."""
    artifact = Path(artifact)
    artifact_kind(artifact)  # a one-line UserError for anything that is not an export, before spawning
    _check_counts(threads=threads, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, repeats=repeats,
                  ctx=n_ctx)
    threads = threads or default_threads()
    plan = (f"{artifact.name}: load, a warm-up and {repeats} runs of a {prompt_tokens}-token "
            f"prompt and {decode_tokens} decode tokens, {threads} threads")
    with stage_lines("bench", plan) as stage, counted("measured", repeats, "runs") as count:
        result = _measure_in_child(artifact, threads, prompt_tokens, decode_tokens, repeats, n_ctx, count)
        stage.figures = _figures(result)
    return result


def _figures(result: BenchResult) -> str:
    """The measurement on one line (bench's end line in a log)."""
    return (f"load {result.load_seconds * 1000:.0f} ms, first token "
            f"{result.time_to_first_token_seconds * 1000:.0f} ms, prompt "
            f"{result.prompt_tokens_per_second:.1f} tokens/s, decode "
            f"{result.decode_tokens_per_second:.1f} tokens/s, peak RSS "
            f"{result.peak_rss_bytes / 2**20:.0f} MiB")


def _measure_in_child(artifact: Path, threads: int, prompt_tokens: int, decode_tokens: int, repeats: int,
                      n_ctx: Optional[int], count: Count) -> BenchResult:
    """Run ``python -m slm_align.ondevice.agent.bench`` and read its result; each run it reports on
    stdout advances ``count``. Its stderr goes to a file (read for its error line), so that a chatty
    runtime cannot block it."""
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="slm-align-bench-") as tmp:
        out = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "slm_align.ondevice.agent.bench", str(artifact), "--threads", str(threads),
                   "--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens), "--repeats",
                   str(repeats), "--out", str(out), "--report-runs"] + (["--ctx", str(n_ctx)] if n_ctx else [])
        with open(Path(tmp) / "stderr.txt", "w+", encoding="utf-8") as errors:
            with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env) as child:
                for line in child.stdout:
                    if line.strip() == RUN_DONE:
                        count.advance()
            errors.seek(0)
            stderr = errors.read()
        if child.returncode == EXIT_USER_ERROR:
            lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
            raise UserError(lines[-1].removeprefix("error: ") if lines else stderr.strip()[-500:])
        if child.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the measuring process failed (exit "
                               f"{child.returncode}):\n{stderr[-3000:]}")
        return BenchResult.from_dict(json.loads(out.read_text(encoding="utf-8")))


@dataclass(frozen=True)
class BenchPlan:
    """What one measurement runs (see :func:`bench`)."""

    threads: Optional[int] = None
    """CPU threads of the runtime (None:
    :func:`~slm_align.ondevice.devices.host.default_threads`)."""
    prompt_tokens: int = 128
    """Tokens of the prompt fed to an empty cache."""
    decode_tokens: int = 64
    """Tokens generated after the first, one forward pass each."""
    repeats: int = 3
    """Measured runs (after one warm-up); the figures are their medians."""
    n_ctx: Optional[int] = None
    """The context window (None: the runtime's default for the artifact)."""


def run_bench(artifact, plan: BenchPlan = BenchPlan(), device: Optional[str] = None,
              save_as: Optional[str] = None, overwrite: bool = False) -> dict:
    """Measure as ``plan`` says, optionally save the host profile as ``save_as`` and compare with
    the ``device`` profile's prediction; a JSON-ready dict.

    Bad names (unknown device, existing profile without ``overwrite``) fail
    before anything is measured.
    """
    if save_as:
        profile_path(save_as, overwrite)
    if device and device != save_as:
        load_profile(device)
    result = bench(artifact, plan.threads, plan.prompt_tokens, plan.decode_tokens, plan.repeats,
                   plan.n_ctx)
    summary = {"bench": result.to_dict(), "saved_profile": None, "prediction": None}
    if save_as:
        bandwidth = measure_bandwidth()
        path = save_profile(result, save_as, overwrite, bandwidth)
        summary["saved_profile"] = {"name": save_as, "path": str(path), "bandwidth_gbs": round(bandwidth, 2)}
    if device:
        summary["prediction"] = predict(result, load_profile(device))
    return summary


def _report_run() -> None:
    """Tell the calling process that a measured run is done (see :func:`bench`)."""
    sys.stdout.write(RUN_DONE + "\n")
    sys.stdout.flush()


def main(argv: Optional[list[str]] = None) -> int:
    """The measuring process: ``python -m slm_align.ondevice.agent.bench ARTIFACT
    [--out FILE]``; JSON result."""
    parser = argparse.ArgumentParser(prog="python -m slm_align.ondevice.agent.bench",
                                     description="Measure one artifact in this process "
                                                 "(slm-align bench uses it).")
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=None)
    parser.add_argument("--out", default=None, help="Write the JSON result here (default: stdout).")
    parser.add_argument("--report-runs", action="store_true",
                        help=f"Write '{RUN_DONE}' on stdout after each measured run "
                             "(slm-align bench's progress).")
    args = parser.parse_args(argv)
    try:
        _check_counts(threads=args.threads, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                      repeats=args.repeats, ctx=args.ctx)
        result = measure(args.artifact, args.threads or default_threads(), args.prompt_tokens, args.decode_tokens,
                         args.repeats, args.ctx, _report_run if args.report_runs else _nothing)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_USER_ERROR
    text = json.dumps(result.to_dict(), indent=2)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
