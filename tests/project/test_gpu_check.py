"""scripts/gpu_check.sh runs its CPU fallback here, so that the GPU check
cannot rot between GPU runs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_script_passes_its_cpu_fallback(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "refused as it should be: error: --device cuda" in done.stdout
    assert "PASS (CPU fallback" in done.stdout
    assert not (tmp_path / "refused").exists()
