"""Decode speed of our agent runtime vs bare llama-cpp-python, same GGUF,
same settings, one process.

    python benchmarks/agent_vs_llama_cpp.py                 # bundled model and a
    SmolLM2-135M-shaped one python benchmarks/agent_vs_llama_cpp.py --gguf model.gguf --tokens 128
    --threads 4 python benchmarks/agent_vs_llama_cpp.py --gguf gemma-3-270m-base.gguf
    --chat-template chatml   # no template

Both sides answer the same chat message through the same chat template, greedy, for exactly --tokens
tokens (EOS is not sampled: random-weight models rarely pick it, and the bundled model's answers are
checked to reach the budget), with the same thread count and context. Bare is
`Llama.create_chat_completion`, the call an app would make without us; ours is `Agent.chat`. Median
of --repeats alternating runs; the ratio is ours / bare tokens per second (target >= 0.95). A GGUF
without a chat template (a base model) needs --chat-template chatml|FILE: our side gets it through
``Agent.load``, the bare side the same Jinja text as a llama-cpp-python chat handler.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

MESSAGE = "Tell me a long story about a fox and a crow."


def template_handler(llm, option: str):
    """llama-cpp-python's chat handler for ``--chat-template`` (chatml or a Jinja file): the
    Jinja text our side renders, with the model's BOS and EOS, as llama-cpp-python builds one
    from a GGUF's own template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from slm_align.ondevice.templates.chat import chosen_chat_template

    eos = llm.token_eos()
    bos = llm.token_bos()
    formatter = Jinja2ChatFormatter(template=chosen_chat_template(option).source,
                                    eos_token=_token_text(llm, eos), bos_token=_token_text(llm, bos),
                                    stop_token_ids=[eos])
    return formatter.to_chat_handler()


def _token_text(llm, token: int) -> str:
    if token == -1:
        return ""
    return llm.detokenize([token], special=True).decode("utf-8", errors="replace")


def bare_runner(gguf: Path, tokens: int, threads: int, n_ctx: int, chat_template: Optional[str] = None):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    if chat_template is not None:
        llm.chat_handler = template_handler(llm, chat_template)

    def run() -> int:
        out = llm.create_chat_completion([{"role": "user", "content": MESSAGE}], max_tokens=tokens, temperature=0.0)
        return out["usage"]["completion_tokens"]
    return run


def ours_runner(gguf: Path, tokens: int, threads: int, n_ctx: int, chat_template: Optional[str] = None):
    from slm_align.ondevice.agent.runtime import Agent
    from slm_align.ondevice.agent.settings import SamplingParams

    agent = Agent.load(gguf, threads=threads, n_ctx=n_ctx, chat_template=chat_template,
                       sampling=SamplingParams(temperature=0.0, max_tokens=tokens))

    def run() -> int:
        agent.reset()
        return agent.chat(MESSAGE).tokens
    return run


def measure(runners: dict, repeats: int) -> dict:
    """Median tokens/s per runner, runs alternating so that load on the machine hits both alike."""
    for run in runners.values():
        run()  # warm-up
    speeds: dict = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            count = run()
            speeds[name].append(count / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in speeds.items()}


def default_models(work: Path) -> list[Path]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from export_and_decode import smollm2_shaped

    from slm_align.export.publishing.stage import ExportRequest, run_export
    from slm_align.modeling.models import DEFAULT_MODEL_DIR

    bundled = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "gguf", "Q8_0", out=work / "bundled")).stage_dir
    shaped = run_export(ExportRequest(str(smollm2_shaped(work / "smollm2")), "gguf", "Q8_0", out=work / "smollm2",
                                      verify=False)).stage_dir
    return [bundled, shaped]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="append", help="GGUF file (repeatable; "
                                                        "default: two built here)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chat-template", default=None, metavar="chatml|FILE",
                        help="chat template for GGUFs without one (base models): chatml or a Jinja "
                             "file, given to both sides")
    args = parser.parse_args()
    models = [Path(g) for g in args.gguf] if args.gguf else default_models(Path(tempfile.mkdtemp(prefix="slm-agent-")))
    print(f"\n{args.tokens} greedy tokens, {args.threads} threads, context {args.ctx}, "
          f"median of {args.repeats}")
    print(f"{'model':<40}{'bare tok/s':>12}{'ours tok/s':>12}{'ours/bare':>11}")
    for gguf in models:
        speeds = measure({"bare": bare_runner(gguf, args.tokens, args.threads, args.ctx, args.chat_template),
                          "ours": ours_runner(gguf, args.tokens, args.threads, args.ctx, args.chat_template)},
                         args.repeats)
        print(f"{gguf.parent.name + '/' + gguf.name:<40}{speeds['bare']:>12.1f}{speeds['ours']:>12.1f}"
              f"{speeds['ours'] / speeds['bare']:>11.3f}")


if __name__ == "__main__":
    main()
