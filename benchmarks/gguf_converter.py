"""Our GGUF converter vs llama.cpp's convert_hf_to_gguf.py: speed, breadth and what
llama.cpp computes from each.

    python benchmarks/gguf_converter.py                  # the six tiny architectures and a
    SmolLM2-135M-shaped Llama python benchmarks/gguf_converter.py --no-large

Each conversion runs in a fresh process (imports included, as a user's `slm-align export` or `python
convert_hf_to_gguf.py` would), writing F32. llama.cpp's converter comes from the sdist of the
installed llama-cpp-python (tests/llama_cpp_reference.py, cached under ~/.cache/slm-align-tests).
The table gives seconds for each, whether the two files hold bit-identical tensors, and the largest
difference between the logits llama.cpp computes from them on a 64-token probe.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3_text", "gpt_neox", "gpt2"]


def save_model(arch: str, path: Path, hidden: int = 32, layers: int = 2) -> Path:
    from transformers import AutoTokenizer

    from slm_align.modeling.models import DEFAULT_MODEL_DIR, build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    build_tiny_model(arch, len(tokenizer), hidden=hidden, layers=layers).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ours(model_dir: Path, out: Path) -> float:
    code = ("import sys; from pathlib import Path; from slm_align.ondevice.gguf.writer import write_gguf; "
            "write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), 'F32')")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(model_dir), str(out)], check=True, cwd=ROOT)
    return time.perf_counter() - started


def theirs(model_dir: Path, out: Path) -> float:
    from tests.llama_cpp_reference import convert

    started = time.perf_counter()
    convert(model_dir, out)
    return time.perf_counter() - started


def compare(first: Path, second: Path) -> tuple[bool, float]:
    import numpy as np
    from gguf import GGUFReader

    from slm_align.ondevice.agent.open_artifact import open_backend

    tensors = [{t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors} for path in (first, second)]
    identical = tensors[0].keys() == tensors[1].keys() and all(
        np.array_equal(tensors[0][name], tensors[1][name]) for name in tensors[0])
    ids = list(range(3, 67))
    logits = [open_backend(path, all_logits=True, n_ctx=128).feed_all(ids) for path in (first, second)]
    return identical, float(np.abs(logits[0] - logits[1]).max())


def row(label: str, model_dir: Path, scratch: Path) -> str:
    from tests.llama_cpp_reference import ReferenceUnavailable

    mine = scratch / f"{label}-ours.gguf"
    seconds = ours(model_dir, mine)
    try:
        reference = scratch / f"{label}-llama.cpp.gguf"
        their_seconds = theirs(model_dir, reference)
    except ReferenceUnavailable as exc:
        return f"{label:<24} {seconds:>8.2f} {'fails':>10}  {exc}"
    identical, gap = compare(mine, reference)
    return f"{label:<24} {seconds:>8.2f} {their_seconds:>10.2f} {identical!s:>10} {gap:>12.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-large", action="store_true", help="skip the SmolLM2-135M-shaped model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        print(f"{'model':<24} {'ours s':>8} {'llama.cpp s':>10} "
              f"{'identical':>10} {'logit diff':>12}")
        for arch in ARCHITECTURES:
            print(row(arch, save_model(arch, scratch / arch), scratch), flush=True)
        if not args.no_large:
            large = save_model("llama", scratch / "smollm2-135m-shaped", hidden=576, layers=30)
            print(row("llama 576x30 (90M)", large, scratch), flush=True)


if __name__ == "__main__":
    main()
