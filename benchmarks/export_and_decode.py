"""Export time, file size and decode speed: PyTorch vs onnxruntime vs
llama.cpp, one model, one process.

    python benchmarks/export_and_decode.py                    # SmolLM2-135M-shaped Llama, random
    weights python benchmarks/export_and_decode.py --model ./SmolLM2-135M --threads 4

Each artifact is exported by `slm-align export` (parity verification on, as users run it). Decode
speed is greedy decoding of --tokens tokens after a short prompt with the KV cache, median of
--repeats runs, the same thread count everywhere. PyTorch runs HF generate in fp32; onnxruntime runs
our numpy loop over optimum's graph; llama.cpp runs through llama-cpp-python's generate.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = "Once upon a time, there was a little fox who lived in the forest. One day"


def smollm2_shaped(path: Path) -> Path:
    """A Llama with SmolLM2-135M's shape (30 layers, d=576, GQA 9/3, 49k vocab), random
    weights, our tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slm_align.modeling.models import DEFAULT_MODEL_DIR
    from slm_align.ondevice.templates.chat import CHATML_TEMPLATE

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer.chat_template = tokenizer.chat_template or CHATML_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_decode(model_dir: Path, tokens: int, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt")["input_ids"]

    def run():
        with torch.no_grad():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return run


def onnx_decode(artifact: Path, tokens: int, threads: int):
    from slm_align.ondevice.agent.decode import greedy
    from slm_align.ondevice.agent.onnx_backend import OnnxBackend

    backend = OnnxBackend(artifact, threads=threads)
    ids = backend.tokenize(PROMPT)
    return lambda: greedy(backend, ids, tokens, stop_at_eos=False)


def llama_decode(artifact: Path, tokens: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(artifact), n_ctx=512, n_threads=threads, verbose=False)
    ids = llm.tokenize(PROMPT.encode())

    def run():
        llm.reset()
        for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), 1):
            if count == tokens:
                break
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: "
                                        "SmolLM2-135M-shaped random Llama)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf-quant", default="Q8_0")
    parser.add_argument("--onnx-quant", default="int8")
    args = parser.parse_args()

    from slm_align.export.publishing.stage import ExportRequest, run_export

    work = Path(tempfile.mkdtemp(prefix="slm-bench-"))
    model_dir = Path(args.model) if args.model else smollm2_shaped(work / "model")
    rows = []
    artifacts = {}
    for target, quant in (("gguf", args.gguf_quant), ("onnx", args.onnx_quant)):
        start = time.perf_counter()
        result = run_export(ExportRequest(str(model_dir), target, quant, out=work / "export", threads=args.threads,
                                          min_agreement=0.0))
        artifacts[target] = result.stage_dir
        rows.append((target, quant, time.perf_counter() - start, result.metrics["bytes"],
                     result.metrics["verification"]))
    decode = {
        "pytorch fp32": timed(torch_decode(model_dir, args.tokens, args.threads), args.repeats),
        f"onnxruntime {args.onnx_quant}": timed(onnx_decode(artifacts["onnx"], args.tokens, args.threads),
                                                args.repeats),
        f"llama.cpp {args.gguf_quant}": timed(llama_decode(artifacts["gguf"], args.tokens, args.threads),
                                              args.repeats),
    }
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    print(f"\nmodel: {model_dir} ({weights / 1e6:.1f} MB of fp32 safetensors); {args.tokens} "
          f"greedy tokens, {args.threads} threads, median of {args.repeats}")
    print(f"{'artifact':<22}{'export s':>10}{'size MB':>10}{'vs fp32':>9}  verification")
    for target, quant, seconds, size, check in rows:
        greedy = f"greedy {check['greedy_exact']}/{check['prompts']}, " if check["prompts"] else ""
        print(f"{target + ' ' + quant:<22}{seconds:>10.1f}{size / 1e6:>10.1f}{size / weights:>9.2f}  "
              f"{greedy}top-1 agreement {check['agreement']:.3f}, passed {check['passed']}")
    base = decode["pytorch fp32"]
    print(f"\n{'runtime':<22}{'tokens/s':>10}{'vs pytorch':>12}")
    for name, seconds in decode.items():
        print(f"{name:<22}{args.tokens / seconds:>10.1f}{base / seconds:>11.2f}x")


if __name__ == "__main__":
    main()
