"""What ``slm-align env`` reports for a bug report: versions, threads, CPU features,
llama.cpp's build, accelerators.

Every probe is optional: a library that is not installed reads as None (not an error), so the report
works on a board with the agent extra only as well as on a training machine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import re
import sys
from typing import Any, Optional

DISTRIBUTION = "slm-align"
# Libraries every report lists besides the declared requirements: the ones our
# stack pulls in underneath.
ALSO_REPORTED = ("huggingface-hub", "tokenizers", "optimum", "sentencepiece", "tomli", "tensorboard")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def package_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def slm_align_version() -> str:
    """This package's version: its installed metadata, else the source tree's ``__version__``."""
    installed = package_version(DISTRIBUTION)
    if installed is not None:
        return installed
    from slm_align import __version__

    return __version__


def dependency_names() -> list[str]:
    """The distributions slm-align requires (core and every extra, itself excluded) and
    ALSO_REPORTED, sorted."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        requirements = []
    names = set(ALSO_REPORTED)
    for requirement in requirements:
        match = _NAME.match(requirement)
        if match and match.group(0).lower() != DISTRIBUTION:
            names.add(match.group(0).lower())
    return sorted(names)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def torch_facts() -> Optional[dict[str, Any]]:
    """torch's threads, the CPU kernel level it picked, and the accelerators it
    sees; None without torch."""
    if not _installed("torch"):
        return None
    import torch

    cuda = [f"cuda:{index} {torch.cuda.get_device_name(index)}" for index in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    return {"version": torch.__version__, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda": cuda,
            "mps": bool(mps is not None and mps.is_available())}


def llama_cpp_facts() -> Optional[dict[str, Any]]:
    """llama-cpp-python's version and llama.cpp's system info (the CPU features it was built
    for); None without it."""
    if not _installed("llama_cpp"):
        return None
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    if isinstance(info, bytes):
        info = info.decode("utf-8", errors="replace")
    return {"version": llama_cpp.__version__, "system_info": info.strip(" |"),
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


def onnxruntime_providers() -> Optional[list[str]]:
    """onnxruntime's execution providers; None without onnxruntime."""
    if not _installed("onnxruntime"):
        return None
    import onnxruntime

    return list(onnxruntime.get_available_providers())


def accelerators(torch_info: Optional[dict], llama_info: Optional[dict], providers: Optional[list[str]]) -> list[str]:
    """Every accelerator some installed runtime can use; empty on a CPU-only machine."""
    found = list(torch_info["cuda"]) if torch_info else []
    if torch_info and torch_info["mps"]:
        found.append("mps (torch)")
    if llama_info and llama_info["gpu_offload"]:
        found.append("llama.cpp GPU offload")
    for provider in providers or []:
        if provider not in ("CPUExecutionProvider", "AzureExecutionProvider"):
            found.append(f"onnxruntime {provider}")
    return found


def collect_environment() -> dict[str, Any]:
    """The whole report as a JSON-ready dict."""
    from slm_align.ondevice.devices.host import host_facts

    host = host_facts()
    torch_info = torch_facts()
    llama_info = llama_cpp_facts()
    providers = onnxruntime_providers()
    return {
        "slm_align": slm_align_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": {"name": host.cpu, "machine": host.machine, "cores": host.cores, "logical_cpus": host.logical_cpus,
                "ram_gb": host.ram_gb, "features": host.cpu_flags},
        "packages": {name: package_version(name) for name in dependency_names()},
        "torch": torch_info,
        "llama_cpp": llama_info,
        "onnxruntime_providers": providers,
        "accelerators": accelerators(torch_info, llama_info, providers),
    }
