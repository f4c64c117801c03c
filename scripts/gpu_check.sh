#!/usr/bin/env bash
# The GPU check (issue 19): at most 8 minutes on one CUDA GPU.
#   1. the quickstart with --device cuda (SFT, reward model, gate, PPO, evaluation, export, one agent turn);
#   2. the tests marked gpu (tests/modeling/test_accelerator.py: a bf16 GRPO iteration on CUDA, SFT on CUDA, ...);
#   3. benchmarks/grpo_vs_trl.py on the GPU, both sides bf16 (skipped when trl is not installed).
# Without a GPU (or with --cpu) it runs the CPU fallback in well under a minute, which CI runs through
# tests/project/test_gpu_check.py so that the script cannot rot: --device cuda must be refused in one line with exit
# code 2, the gpu tests must collect (and skip), and the benchmark must parse its GPU flags.
#
#   bash scripts/gpu_check.sh            # on a GPU machine: prints each step's figures, exit 0 when all pass
#   bash scripts/gpu_check.sh --cpu      # the CPU fallback
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${GPU_CHECK_OUT:-$(mktemp -d /tmp/slm-align-gpu-check.XXXXXX)}

has_cuda() {
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
}

cpu_fallback() {
  echo "== CPU fallback: refusals (CUDA hidden), gpu tests collected, benchmark flags"
  set +e
  message=$(CUDA_VISIBLE_DEVICES="" "$PYTHON" -m slm_align sft --data demo --device cuda --out "$OUT/refused" 2>&1)
  code=$?
  set -e
  lines=$(printf '%s\n' "$message" | wc -l)
  if [ "$code" -ne 2 ] || [ "$lines" -ne 1 ] || [ -e "$OUT/refused" ]; then
    echo "FAIL: --device cuda without CUDA gave exit $code and $lines lines: $message"
    exit 1
  fi
  echo "refused as it should be: $message"
  "$PYTHON" -m pytest -m gpu tests/modeling/test_accelerator.py -q -p no:cacheprovider
  "$PYTHON" benchmarks/grpo_vs_trl.py --help | grep -q -- "--precision"
  echo "PASS (CPU fallback; no GPU figures measured)"
}

gpu_check() {
  echo "== GPU check on $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')"
  started=$(date +%s)
  echo "-- 1. quickstart --device cuda"
  timeout 270 "$PYTHON" -m slm_align quickstart --device cuda --out "$OUT/quickstart" --json > "$OUT/quickstart.json"
  "$PYTHON" - "$OUT/quickstart.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
print(json.dumps(result, indent=1)[:3000])
PY
  echo "-- 2. tests marked gpu"
  timeout 90 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs
  echo "-- 3. GRPO vs TRL on the GPU (bf16)"
  if "$PYTHON" -c "import trl" 2>/dev/null; then
    timeout 120 "$PYTHON" benchmarks/grpo_vs_trl.py --device cuda --precision bf16 --repeats 1 --iterations 2
  else
    echo "skipped: trl is not installed (pip install trl)"
  fi
  echo "PASS (GPU check, $(( $(date +%s) - started )) s)"
}

if [ "${1:-}" = "--cpu" ] || ! has_cuda; then
  cpu_fallback
else
  gpu_check
fi
