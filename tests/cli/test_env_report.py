"""The basics a user reaches for first: --version and `env` for bug reports."""

import json
import sys

import slm_align
from tests.helpers import run_cli


def test_version_prints_the_package_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"slm-align {slm_align.__version__}"


def test_env_json_reports_versions_threads_cpu_and_runtimes(capsys):
    import llama_cpp
    import torch

    code, out, err = run_cli(capsys, "env", "--json")
    report = json.loads(out)
    assert code == 0, err
    assert report["slm_align"] == slm_align.__version__ and report["python"] == sys.version.split()[0]
    packages = report["packages"]
    assert packages["torch"] == torch.__version__ and packages["typer"] and packages["pydantic"]
    assert packages["llama-cpp-python"] == llama_cpp.__version__
    assert report["torch"]["threads"] == torch.get_num_threads()
    assert report["torch"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "CPU" in report["llama_cpp"]["system_info"]  # llama.cpp's own build flags (AVX2 = 1 | ...)
    assert report["cpu"]["logical_cpus"] >= 1 and isinstance(report["cpu"]["features"], list)
    assert isinstance(report["accelerators"], list)
    assert ("cuda:0" in " ".join(report["accelerators"])) == torch.cuda.is_available()


def test_env_for_people_names_each_part(capsys):
    code, out, _ = run_cli(capsys, "env")
    assert code == 0
    for part in ("slm-align", "CPU:", "torch:", "llama.cpp:", "accelerators:", "packages:"):
        assert part in out


def nothing_installed(module: str) -> bool:
    """As on a board without torch, llama.cpp or onnxruntime."""
    return False


def test_env_reports_a_missing_library_as_not_installed(monkeypatch):
    from slm_align.cli import env_report as environment

    monkeypatch.setattr(environment, "ALSO_REPORTED", ("no-such-distribution-xyz",))
    monkeypatch.setattr(environment, "_installed", nothing_installed)
    report = environment.collect_environment()
    assert report["packages"]["no-such-distribution-xyz"] is None
    assert report["torch"] is None and report["llama_cpp"] is None and report["accelerators"] == []
