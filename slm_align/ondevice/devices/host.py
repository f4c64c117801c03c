"""Facts about this host for device profiles and measurements: CPU model and ISA flags,
cores, RAM, a memory bandwidth probe, and the process's peak resident memory. Imports
neither torch nor transformers.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

BANDWIDTH_MB = 256            # size of the array the bandwidth probe copies
BANDWIDTH_REPEATS = 5         # copies; the best one counts
MAX_DEFAULT_THREADS = 16      # the most threads a command takes unless told (see free_threads)
# ISA flags as /proc/cpuinfo names them -> the device-profile vocabulary (profiles.ISA_FEATURES)
X86_FLAGS = {"sse4_2": "sse4", "avx": "avx", "avx2": "avx2", "avx512f": "avx512",
             "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni", "amx_int8": "amx"}
ARM_FLAGS = {"asimd": "neon", "asimddp": "dotprod", "i8mm": "i8mm", "asimdhp": "fp16",
             "bf16": "bf16", "sve": "sve", "sve2": "sve2", "sme": "sme"}


@dataclass(frozen=True)
class HostFacts:
    """The machine a measurement ran on."""

    # CPU model name (/proc/cpuinfo, device tree or sysctl)
    cpu: str
    machine: str                                # platform.machine(): x86_64, aarch64, arm64, ...
    cores: int                                  # physical cores
    logical_cpus: int                           # logical CPUs this process may run on
    ram_gb: float                               # installed RAM in GiB
    # ISA flags of interest, as the OS names them (avx2, asimddp)
    cpu_flags: list[str] = field(default_factory=list)
    # the same in device-profile words (avx2, avx512, neon, dotprod)
    isa: list[str] = field(default_factory=list)


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
    """CPU (or board) model name: x86 'model name', the device tree's model on ARM
    boards, sysctl on macOS."""
    fields = _cpuinfo_fields(cpuinfo)
    board = _read("/proc/device-tree/model").strip("\x00 \n")
    name = fields.get("model "
                      "name") or board or fields.get("hardware") or fields.get("processor", "")
    if sys.platform == "darwin":
        name = _sysctl("machdep.cpu.brand_string") or name
    if not name or name.isdigit():  # ARM cpuinfo's 'processor' is just the CPU index
        name = platform.processor() or platform.machine() or "unknown CPU"
    return " ".join(name.split())


def cpu_flags(cpuinfo: str, machine: str) -> list[str]:
    """ISA flags of interest that /proc/cpuinfo lists ('flags' on x86, 'Features' on ARM)."""
    fields = _cpuinfo_fields(cpuinfo)
    present = set((fields.get("flags", "") + " " + fields.get("features", "")).split())
    if not present and machine.lower() in ("arm64", "aarch64"):
        # macOS / no cpuinfo: Armv8 always has NEON
        present = {"asimd"} | ({"asimddp"} if _sysctl("hw.optional.arm.FEAT_DotProd") == "1"
                               else set()) \
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
                     logical_cpus=logical_cpus(), ram_gb=round(ram_bytes() / 2**30, 2),
                     cpu_flags=flags, isa=profile_isa(flags))


def usable_cores() -> int:
    """Physical cores this process may use (llama.cpp's advice: hyperthreads
    do not speed up decode)."""
    return max(1, min(physical_cores(_read("/proc/cpuinfo")), logical_cpus()))


def free_threads(cores: int, load: float, omp_num_threads: Optional[str] = None,
                 cap: int = MAX_DEFAULT_THREADS) -> int:
    """The default number of CPU threads of a command: ``OMP_NUM_THREADS`` when the user set it to
    a whole number >= 1 (the first of a nested list such as ``4,2``); else the ``cores`` this
    process may use less the host's 1-minute ``load`` average, rounded to the nearest whole core,
    at least 1 and at most ``cap``.

    Why not one thread per core: a thread that finds no free core waits its turn, and every
    operation's barrier waits for the slowest thread, so one thread too many costs far more than
    one core. On a 2-core host with another job running, PyTorch greedy decoding of SmolLM2-135M ran
    at 0.8-2.4 tokens/s with 2 threads against about 17 with 1, and llama.cpp's bench at 5.2 against
    50.1 (issue 44). The load average counts the jobs running or waiting to run, so cores less load
    are the cores nobody else is using. ``OMP_NUM_THREADS`` is the user's own choice, the variable
    PyTorch and OpenMP read, and is taken as it is; a value that is no whole number >= 1 is ignored,
    as OpenMP ignores it. The cap is a judgement, not a measurement: decoding a small model is bound
    by memory bandwidth, which a few threads fill, while each thread more adds to every barrier.
    Written here rather than taken from a library: neither PyTorch (one thread per physical core)
    nor llama.cpp (half the logical CPUs) looks at the load.
    """
    if omp_num_threads is not None:
        first = omp_num_threads.split(",")[0].strip()
        if first.isdigit() and int(first) >= 1:
            return int(first)
    free = int(cores - load + 0.5)
    return max(1, min(cap, free))


def load_average() -> float:
    """The host's 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; a platform that cannot tell
        return 0.0


@functools.cache
def default_threads() -> int:
    """This process's default thread count (:func:`free_threads` of this host now), decided once,
    at its first use: a command asks before it computes, so the load it adds itself later (a
    training stage before an evaluation in the same run) never counts against it."""
    return free_threads(usable_cores(), load_average(), os.environ.get("OMP_NUM_THREADS"))


def measure_bandwidth(megabytes: int = BANDWIDTH_MB, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Memory bandwidth in GB/s from the best of a few numpy copies of a large array
    (bytes read plus written, as STREAM's copy counts them; one thread, so a lower bound
    on what all cores reach)."""
    source = np.ones(megabytes * 2**20 // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


# --- the measurement (runs in the child process) --------------------------------------------------

def peak_rss_bytes() -> int:
    """This process's RSS high-water mark.

    Linux: VmHWM of /proc/self/status, the high-water mark of this process's own address space.
    ``ru_maxrss`` is not used there because exec carries the parent's high-water mark over into it:
    a child started by a 2 GB training process would report at least 2 GB. Elsewhere ``ru_maxrss``
    (bytes on macOS, KiB otherwise).
    """
    match = re.search(r"^VmHWM:\s+(\d+)\s*kB", _read("/proc/self/status"), re.MULTILINE)
    if match:
        return int(match.group(1)) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
