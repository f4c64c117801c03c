"""benchmarks/mobile_runtimes.py runs every side in its own process on a GGUF and a genai folder of
one model and prints one row per side (the real figures are in the README; here a tiny Llama keeps
the script from rotting), and a .pte side when ExecuTorch is installed."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from slm_align.export.publishing.stage import ExportRequest, run_export

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("llama_cpp")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mobile_runtimes.py"


def test_every_runtime_side_reports_speed_and_memory(tiny_models, tmp_path):
    gguf = run_export(ExportRequest(str(tiny_models["llama"]), "gguf", "F32", out=tmp_path, verify=False)).stage_dir
    genai = run_export(ExportRequest(str(tiny_models["llama"]), "genai", "fp32", out=tmp_path,
                                     verify=False)).stage_dir
    command = [sys.executable, str(SCRIPT), "--gguf", str(gguf), "--genai", str(genai), "--repeats", "1",
               "--tokens", "4", "--prompt-tokens", "8", "--threads", "1"]
    sides = {"llama.cpp", "genai", "ours gguf", "ours onnx", "ours genai"}
    if importlib.util.find_spec("executorch") is not None:
        program = run_export(ExportRequest(str(tiny_models["llama"]), "executorch", out=tmp_path, verify=False))
        command += ["--executorch", str(program.stage_dir)]
        sides.add("executorch")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line[:12].strip(): line[12:].split() for line in done.stdout.splitlines() if line[:12].strip() in sides}
    assert set(rows) == sides
    assert rows["llama.cpp"][1] == "1.00x" and rows["llama.cpp"][3] == "1.00x"
    for figures in rows.values():
        assert float(figures[0]) > 0 and float(figures[2]) > 0  # decode tok/s, peak RSS MiB
