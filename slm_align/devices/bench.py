"""Measure an exported model on this host: load time, time to first token, prompt and decode speed, peak memory.

The measurement runs in a fresh Python process (``python -m slm_align.devices.bench ARTIFACT ...``), so the peak
resident set size (VmHWM on Linux, else ``ru_maxrss``) is the artifact's and its runtime's, not the caller's; the
child also reports the high-water mark before the model is loaded (interpreter, numpy and the runtime library) as
the baseline.

After one short warm-up run, per repeat: the prompt of exactly ``prompt_tokens`` tokens is fed to an empty cache
(prompt processing), the first token is taken greedily from its logits (time to first token), then ``decode_tokens``
more tokens are generated one forward pass each (decode speed; end-of-sequence is ignored, as llama-bench does).
Figures are medians over the repeats. ``--save-profile`` turns the result into a user device profile (with a
numpy-copy bandwidth figure and this measurement as its reference point) that ``slm-align devices fit`` can use.
Imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from slm_align.atomic import write_text_atomic
from slm_align.errors import EXIT_USER_ERROR, UserError
from slm_align.progress import Count, counted, stage_lines

APP_MEMORY_SHARE = 0.7        # share of RAM a saved host profile lets one app use
BANDWIDTH_MB = 256            # size of the array the bandwidth probe copies
BANDWIDTH_REPEATS = 5         # copies; the best one counts
PROMPT_TEXT = ("Once upon a time, a small robot lived in a quiet town by the sea. Every morning it walked to the "
               "harbour, counted the boats and told the children a new story about the stars. ")
# ISA flags as /proc/cpuinfo names them -> the device-profile vocabulary (profiles.ISA_FEATURES)
X86_FLAGS = {"sse4_2": "sse4", "avx": "avx", "avx2": "avx2", "avx512f": "avx512", "avx512_vnni": "avx512_vnni",
             "avx_vnni": "avx_vnni", "amx_int8": "amx"}
ARM_FLAGS = {"asimd": "neon", "asimddp": "dotprod", "i8mm": "i8mm", "asimdhp": "fp16", "bf16": "bf16",
             "sve": "sve", "sve2": "sve2", "sme": "sme"}
PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
RUN_DONE = "run done"  # what the measuring process writes on stdout after each measured run (its progress)


@dataclass(frozen=True)
class HostFacts:
    """The machine a measurement ran on."""

    cpu: str                                    # CPU model name (/proc/cpuinfo, device tree or sysctl)
    machine: str                                # platform.machine(): x86_64, aarch64, arm64, ...
    cores: int                                  # physical cores
    logical_cpus: int                           # logical CPUs this process may run on
    ram_gb: float                               # installed RAM in GiB
    cpu_flags: list[str] = field(default_factory=list)  # ISA flags of interest, as the OS names them (avx2, asimddp)
    isa: list[str] = field(default_factory=list)        # the same in device-profile words (avx2, avx512, neon, dotprod)


@dataclass(frozen=True)
class BenchResult:
    """One artifact measured on this host (speeds are medians over the repeats)."""

    artifact: str                        # the measured .gguf file or ONNX export directory
    kind: str                            # gguf (llama.cpp) or onnx (onnxruntime)
    model: str                           # model name from the artifact (GGUF general.name, else the file/dir name)
    runtime: str                         # runtime and version that ran it
    threads: int                         # threads the runtime was given
    n_ctx: int                           # context window the model was opened with
    prompt_tokens: int                   # tokens in the prompt fed at once
    decode_tokens: int                   # tokens generated after the first one, one forward pass each
    repeats: int                         # measurement repeats (the model is loaded once)
    generated_tokens: int                # tokens generated per repeat: the first one plus decode_tokens
    load_seconds: float                  # opening the artifact (weights, tokenizer, session/context)
    time_to_first_token_seconds: float   # prompt fed to an empty cache plus the first token chosen
    prompt_tokens_per_second: float      # prompt processing speed
    decode_tokens_per_second: float      # greedy decode speed, the first token excluded
    decode_runs: list[float]             # decode tokens/s of each repeat
    rss_before_load_bytes: int           # RSS high-water mark of the measuring process before loading the model
    peak_rss_bytes: int                  # RSS high-water mark of the measuring process at the end
    host: HostFacts                      # where it ran

    @property
    def model_rss_bytes(self) -> int:
        """Peak memory added by loading and running the model (peak minus the baseline)."""
        return self.peak_rss_bytes - self.rss_before_load_bytes

    @property
    def kv_context(self) -> int:
        """Tokens in the KV cache during decode, on average (the context a reference point records)."""
        return self.prompt_tokens + self.decode_tokens // 2

    def to_dict(self) -> dict:
        return dict(asdict(self), model_rss_bytes=self.model_rss_bytes)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchResult":
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**dict(data, host=HostFacts(**data["host"])))


# --- host facts ---------------------------------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """First value of each key in /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_name(cpuinfo: str) -> str:
    """CPU (or board) model name: x86 'model name', the device tree's model on ARM boards, sysctl on macOS."""
    fields = _cpuinfo_fields(cpuinfo)
    board = _read("/proc/device-tree/model").strip("\x00 \n")
    name = fields.get("model name") or board or fields.get("hardware") or fields.get("processor", "")
    if sys.platform == "darwin":
        name = _sysctl("machdep.cpu.brand_string") or name
    if not name or name.isdigit():  # ARM cpuinfo's 'processor' is just the CPU index
        name = platform.processor() or platform.machine() or "unknown CPU"
    return " ".join(name.split())


def cpu_flags(cpuinfo: str, machine: str) -> list[str]:
    """ISA flags of interest that /proc/cpuinfo lists ('flags' on x86, 'Features' on ARM)."""
    fields = _cpuinfo_fields(cpuinfo)
    present = set((fields.get("flags", "") + " " + fields.get("features", "")).split())
    if not present and machine.lower() in ("arm64", "aarch64"):  # macOS / no cpuinfo: Armv8 always has NEON
        present = {"asimd"} | ({"asimddp"} if _sysctl("hw.optional.arm.FEAT_DotProd") == "1" else set()) \
                  | ({"i8mm"} if _sysctl("hw.optional.arm.FEAT_I8MM") == "1" else set())
    return [flag for flag in (*X86_FLAGS, *ARM_FLAGS) if flag in present]


def profile_isa(flags: Sequence[str]) -> list[str]:
    """ISA flags in the device-profile vocabulary."""
    names = X86_FLAGS | ARM_FLAGS
    return list(dict.fromkeys(names[flag] for flag in flags if flag in names))


def physical_cores(cpuinfo: str) -> int:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo, else the logical CPU count."""
    pairs = set()
    physical = "0"
    for line in cpuinfo.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "physical id":
            physical = value
        elif key == "core id":
            pairs.add((physical, value))
    return len(pairs) or logical_cpus()


def logical_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def ram_bytes() -> int:
    """Installed RAM: MemTotal from /proc/meminfo, else sysconf, else sysctl hw.memsize."""
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read("/proc/meminfo"), re.MULTILINE)
    if match:
        return int(match.group(1)) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return int(_sysctl("hw.memsize") or 0)


def host_facts() -> HostFacts:
    """CPU name, cores, RAM and ISA flags of this host."""
    cpuinfo = _read("/proc/cpuinfo")
    machine = platform.machine()
    flags = cpu_flags(cpuinfo, machine)
    return HostFacts(cpu=cpu_name(cpuinfo), machine=machine, cores=physical_cores(cpuinfo),
                     logical_cpus=logical_cpus(), ram_gb=round(ram_bytes() / 2**30, 2), cpu_flags=flags,
                     isa=profile_isa(flags))


def default_threads() -> int:
    """Physical cores this process may use (llama.cpp's advice: hyperthreads do not speed up decode)."""
    return max(1, min(physical_cores(_read("/proc/cpuinfo")), logical_cpus()))


def measure_bandwidth(megabytes: int = BANDWIDTH_MB, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Memory bandwidth in GB/s from the best of a few numpy copies of a large array (bytes read plus written,
    as STREAM's copy counts them; one thread, so a lower bound on what all cores reach)."""
    source = np.ones(megabytes * 2**20 // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


# --- the measurement (runs in the child process) ------------------------------------------------------------

def peak_rss_bytes() -> int:
    """This process's RSS high-water mark.

    Linux: VmHWM of /proc/self/status, the high-water mark of this process's own address space. ``ru_maxrss``
    is not used there because exec carries the parent's high-water mark over into it: a child started by a
    2 GB training process would report at least 2 GB. Elsewhere ``ru_maxrss`` (bytes on macOS, KiB otherwise).
    """
    match = re.search(r"^VmHWM:\s+(\d+)\s*kB", _read("/proc/self/status"), re.MULTILINE)
    if match:
        return int(match.group(1)) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _runtime(kind: str) -> str:
    """Import the runtime library (so the baseline includes it) and name it with its version."""
    if kind == "gguf":
        try:
            import llama_cpp
        except ImportError:
            raise UserError("GGUF artifacts need llama-cpp-python: pip install 'slm-align[agent]'") from None
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
    """Exactly ``count`` prompt tokens: a story sentence repeated, tokenized by the artifact's own tokenizer."""
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
    """Load ``artifact`` in this process and time it; the peak RSS is this process's (see :func:`bench`).
    ``on_run`` is called after each measured run (outside its timing)."""
    from slm_align.agent.backend import artifact_kind
    from slm_align.agent.open_artifact import open_backend

    artifact = Path(artifact)
    kind = artifact_kind(artifact)
    runtime = _runtime(kind)
    baseline = peak_rss_bytes()
    start = time.perf_counter()
    backend = open_backend(artifact, threads=threads, n_ctx=n_ctx)
    load_seconds = time.perf_counter() - start
    if prompt_tokens + decode_tokens > backend.n_ctx:
        raise UserError(f"--prompt-tokens {prompt_tokens} + --decode-tokens {decode_tokens} exceed the context "
                        f"window of {backend.n_ctx} tokens; lower them or raise --ctx")
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
    """Measure ``artifact`` (.gguf file or ONNX export directory) on this host, in a fresh subprocess."""
    from slm_align.agent.backend import artifact_kind

    artifact = Path(artifact)
    artifact_kind(artifact)  # a one-line UserError for anything that is not an export, before spawning
    _check_counts(threads=threads, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, repeats=repeats,
                  ctx=n_ctx)
    threads = threads or default_threads()
    plan = (f"{artifact.name}: load, a warm-up and {repeats} runs of a {prompt_tokens}-token prompt and "
            f"{decode_tokens} decode tokens, {threads} threads")
    with stage_lines("bench", plan) as stage, counted("measured", repeats, "runs") as count:
        result = _measure_in_child(artifact, threads, prompt_tokens, decode_tokens, repeats, n_ctx, count)
        stage.figures = _figures(result)
    return result


def _figures(result: BenchResult) -> str:
    """The measurement on one line (bench's end line in a log)."""
    return (f"load {result.load_seconds * 1000:.0f} ms, first token {result.time_to_first_token_seconds * 1000:.0f} "
            f"ms, prompt {result.prompt_tokens_per_second:.1f} tokens/s, decode "
            f"{result.decode_tokens_per_second:.1f} tokens/s, peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB")


def _measure_in_child(artifact: Path, threads: int, prompt_tokens: int, decode_tokens: int, repeats: int,
                      n_ctx: Optional[int], count: Count) -> BenchResult:
    """Run ``python -m slm_align.devices.bench`` and read its result; each run it reports on stdout advances
    ``count``. Its stderr goes to a file (read for its error line), so that a chatty runtime cannot block it."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="slm-align-bench-") as tmp:
        out = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "slm_align.devices.bench", str(artifact), "--threads", str(threads),
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
            raise RuntimeError(f"the measuring process failed (exit {child.returncode}):\n{stderr[-3000:]}")
        return BenchResult.from_dict(json.loads(out.read_text(encoding="utf-8")))


# --- comparison with a profile's prediction ----------------------------------------------------------------

def predict(result: BenchResult, profile) -> dict:
    """``estimate_fit``'s decode speed for the measured artifact on ``profile``, beside the measurement."""
    from slm_align.devices.estimate import estimate_fit
    from slm_align.devices.facts import model_facts

    facts = model_facts(result.artifact)
    report = estimate_fit(facts, profile, quant=facts.quant, context=result.kv_context)
    return {"device": profile.name, "quant": report.quant, "context": report.context,
            "predicted_tokens_per_second": report.tokens_per_second,
            "measured_tokens_per_second": result.decode_tokens_per_second,
            "ratio": result.decode_tokens_per_second / report.tokens_per_second,
            "efficiency": report.efficiency.value, "efficiency_basis": report.efficiency.basis,
            "verdict": report.verdict}


# --- saving a host profile -----------------------------------------------------------------------------------

def user_profile_dir() -> Path:
    """Where saved profiles go: $SLM_ALIGN_DEVICES if set, else ~/.config/slm-align/devices/."""
    from slm_align.devices.profiles import ENV_DIR

    return Path(os.environ[ENV_DIR]).expanduser() if os.environ.get(ENV_DIR) else \
        Path.home() / ".config" / "slm-align" / "devices"


def profile_path(name: str, overwrite: bool = False) -> Path:
    """The file a profile called ``name`` is saved to; refuses a bad name or an existing file (unless overwrite)."""
    if not PROFILE_NAME.match(name):
        raise UserError(f"--save-profile '{name}': use letters, digits, '.', '_' and '-' only (e.g. my-laptop)")
    path = user_profile_dir() / f"{name}.toml"
    if path.exists() and not overwrite:
        raise UserError(f"device profile {path} already exists; pass --overwrite to replace it or choose another name")
    return path


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(data: dict) -> str:
    """Flat keys, then each list of dicts as an array of tables (all a device profile needs)."""
    tables = {key: value for key, value in data.items() if isinstance(value, list) and value
              and all(isinstance(item, dict) for item in value)}
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items() if key not in tables and value is not None]
    for key, rows in tables.items():
        for row in rows:
            lines += ["", f"[[{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in row.items() if v is not None]
    return "\n".join(lines) + "\n"


def _onnx_preset(isa: Sequence[str], machine: str) -> str:
    if "neon" in isa or machine.lower() in ("arm64", "aarch64"):
        return "arm64"
    return next((preset for preset in ("avx512_vnni", "avx512") if preset in isa), "avx2")


def profile_data(result: BenchResult, bandwidth_gbs: float, facts, today: Optional[str] = None) -> dict:
    """A device profile (TOML keys) for this host, with ``result`` as its one reference point."""
    from slm_align.devices.quant import GGUF_TYPES

    today = today or datetime.date.today().isoformat()
    host = result.host
    reference = None
    if facts.quant:
        reference = {"model": result.model, "parameters": facts.parameters, "quant": facts.quant,
                     "tokens_per_second": round(result.decode_tokens_per_second, 2), "context": result.kv_context,
                     "size_gb": facts.weight_bytes / 1e9 if facts.weight_bytes else None, "layers": facts.layers,
                     "kv_heads": facts.kv_heads, "head_dim": facts.head_dim, "runtime": result.runtime,
                     "source": f"slm-align bench on this host, {today}"}
    return {
        "display_name": f"this host: {host.cpu}",
        "ram_gb": host.ram_gb,
        "app_memory_share": APP_MEMORY_SHARE,
        "cores": host.cores,
        "threads": result.threads,
        "isa": host.isa,
        "bandwidth_gbs": round(bandwidth_gbs, 2),
        "bandwidth_source": f"measured by slm-align bench with a numpy copy ({BANDWIDTH_MB} MB, best of "
                            f"{BANDWIDTH_REPEATS}, one thread), {today}",
        "runtime": result.kind,
        "gguf_quant": facts.quant if result.kind == "gguf" and facts.quant in GGUF_TYPES else "Q4_K_M",
        "onnx_preset": _onnx_preset(host.isa, host.machine),
        "notes": f"Written by `slm-align bench {result.artifact}` ({result.threads} threads, "
                 f"{result.prompt_tokens}-token prompt, {result.decode_tokens} decode tokens)."
                 + ("" if reference else " No reference point: the artifact's weight type is unknown."),
        "reference": [reference] if reference else [],
    }


def save_profile(result: BenchResult, name: str, overwrite: bool = False,
                 bandwidth_gbs: Optional[float] = None) -> Path:
    """Write ``result`` as the user device profile ``name`` (validated, atomically); the file's path."""
    from pydantic import ValidationError

    from slm_align.devices.facts import model_facts
    from slm_align.devices.profiles import DeviceProfile, tomllib

    path = profile_path(name, overwrite)
    data = profile_data(result, measure_bandwidth() if bandwidth_gbs is None else bandwidth_gbs,
                        model_facts(result.artifact))
    text = to_toml(data)
    try:
        DeviceProfile(name=name, **tomllib.loads(text))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        raise UserError(f"cannot save profile '{name}': {where + ': ' if where else ''}{error['msg']}") from None
    return write_text_atomic(path, text)


# --- what the CLI calls --------------------------------------------------------------------------------------

def run_bench(artifact, threads: Optional[int] = None, prompt_tokens: int = 128, decode_tokens: int = 64,
              repeats: int = 3, n_ctx: Optional[int] = None, device: Optional[str] = None,
              save_as: Optional[str] = None, overwrite: bool = False) -> dict:
    """Measure, optionally save the host profile and compare with a profile's prediction; a JSON-ready dict.

    Bad names (unknown device, existing profile without ``overwrite``) fail before anything is measured.
    """
    from slm_align.devices.profiles import load_profile

    if save_as:
        profile_path(save_as, overwrite)
    if device and device != save_as:
        load_profile(device)
    result = bench(artifact, threads, prompt_tokens, decode_tokens, repeats, n_ctx)
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
    """The measuring process: ``python -m slm_align.devices.bench ARTIFACT [--out FILE]``; JSON result."""
    parser = argparse.ArgumentParser(prog="python -m slm_align.devices.bench",
                                     description="Measure one artifact in this process (slm-align bench uses it).")
    parser.add_argument("artifact")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=None)
    parser.add_argument("--out", default=None, help="Write the JSON result here (default: stdout).")
    parser.add_argument("--report-runs", action="store_true",
                        help=f"Write '{RUN_DONE}' on stdout after each measured run (slm-align bench's progress).")
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
