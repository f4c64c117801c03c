"""Tool-use tasks: write the bundled calculator task or the function-calling family
(``tasks make``) and judge exported models on task rows in the agent runtime (``evaluate-agent``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from slm_align.cli.options import CallThresholdOpt, ChatTemplateOpt, JsonFlag, ThreadsOpt
from slm_align.cli.render import emit, stdout
from slm_align.data.function_tasks import CATEGORIES
from slm_align.errors import UserError

commands = typer.Typer()
tasks_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="markdown",
    help="Tool-use task data: the bundled calculator task or the function-calling family (SFT "
         "chats, RL task rows, held-out rows).",
    epilog="Examples:\n\n  slm-align tasks make --out data/calc\n\n"
           "  slm-align tasks make --kind functions --out data/functions --seed 1 --json")
commands.add_typer(tasks_app, name="tasks")

KINDS = {"calculator": (400, 100), "functions": (1000, 250)}
"""Task kinds and their default (training, held-out) counts."""


@tasks_app.command("make", epilog="Examples:\n\n  slm-align tasks make --out data/calc\n\n  "
                                  "slm-align tasks make --out data/calc --train 800 --heldout 200 "
                                  "--seed 1 --json\n\n  slm-align tasks make --kind functions --out "
                                  "data/functions --train 2000 --heldout 400\n\nThen: slm-align train "
                                  "--data data/calc/sft.jsonl ... and slm-align evaluate-agent "
                                  "data/calc/heldout.jsonl --artifact model.gguf")
def tasks_make(
    out: Path = typer.Option(..., "--out", "--output-dir", help="Directory for sft.jsonl, "
                             "train.jsonl and heldout.jsonl."),
    kind: str = typer.Option("calculator", "--kind", help="calculator (arithmetic and unit "
                             "questions) or functions (BFCL-style function calling over a library "
                             "of app functions; held-out rows use functions training never saw)."),
    train: Optional[int] = typer.Option(None, "--train", min=1, help="Training tasks (default 400 "
                                        "for calculator, each two SFT chats; 1000 for functions, "
                                        "at most 20000)."),
    heldout: Optional[int] = typer.Option(None, "--heldout", min=0, help="Held-out tasks for "
                                          "evaluation (default 100 for calculator; 250 for "
                                          "functions, at most 5000)."),
    seed: int = typer.Option(0, "--seed", help="Generation seed: the same seed "
                                               "writes the same files."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace files already in --out."),
    memory_share: float = typer.Option(0.0, "--memory-share", min=0.0, max=1.0,
                                       help="Share of training tasks whose SFT chat answers from memory, "
                                            "without the tool (a teacher's habit RL can correct; "
                                            "calculator only)."),
    twins: bool = typer.Option(False, "--twins", help="Give each training irrelevance row a twin: "
                               "the same request with its function offered too, answered by a "
                               "call (functions only; the held-out rows do not change)."),
    as_json: bool = JsonFlag,
) -> None:
    """Write a bundled tool-use task: the calculator's arithmetic and unit questions, split
    with no shared question, or the function-calling family (simple, multiple, parallel,
    parallel_multiple and irrelevance rows), split by function."""
    from slm_align.data.agent_tasks import write_agent_tasks
    from slm_align.data.function_tasks import write_function_tasks

    if kind not in KINDS:
        raise UserError(f"--kind {kind!r} is not a task kind; use one of {', '.join(KINDS)}")
    if kind != "calculator" and memory_share:
        raise UserError("--memory-share applies to --kind calculator only; leave it out")
    if kind != "functions" and twins:
        raise UserError("--twins applies to --kind functions only; leave it out")
    train = KINDS[kind][0] if train is None else train
    heldout = KINDS[kind][1] if heldout is None else heldout
    if kind == "functions":
        paths = write_function_tasks(out, train=train, heldout=heldout, seed=seed, overwrite=overwrite,
                                     twins=twins)
    else:
        paths = write_agent_tasks(out, train, heldout, seed, overwrite=overwrite,
                                  memory_share=memory_share)
    counts = {name: sum(1 for _ in path.open(encoding="utf-8")) for name, path in paths.items()}
    result = {"kind": kind, "files": {name: str(path) for name, path in paths.items()}, "rows": counts,
              "seed": seed, "memory_share": memory_share}
    if kind == "functions":
        result["categories"] = _categories(paths)
        result["twins"] = twins

    def human() -> None:
        for name, path in paths.items():
            stdout.print(f"{name}: {path} ({counts[name]} rows)")

    emit(as_json, result, human)


def _categories(paths: dict) -> dict:
    """Rows per category of the train and held-out files."""
    counted = {}
    for name in ("train", "heldout"):
        categories = [json.loads(line)["category"] for line in paths[name].open(encoding="utf-8")]
        counted[name] = {category: categories.count(category) for category in CATEGORIES}
    return counted


FAILURE_LABELS = {"no_call": "no call", "malformed_call": "malformed", "wrong_tool": "wrong tool",
                  "wrong_answer": "wrong answer"}
TOP_FAILURES = 2
"""Failure categories the printed table names per artifact, the commonest first."""


@commands.command("evaluate-agent", epilog="Examples:\n\n  slm-align evaluate-agent "
                  "data/calc/heldout.jsonl --artifact runs/demo/export/model-Q8_0.gguf\n\n  "
                  "slm-align evaluate-agent data/calc/heldout.jsonl --artifact sft/model-Q8_0.gguf "
                  "--artifact rl/model-Q8_0.gguf --limit 50 --out agent-report.json --json\n\n  "
                  "slm-align evaluate-agent data/calc/heldout.jsonl --artifact rl/model-Q8_0.gguf "
                  "--samples 5 --temperature 0.7 --max-tool-rounds 2   # pass@5 and pass@1\n\n  "
                  "slm-align evaluate-agent --bfcl simple_python,multiple,parallel,parallel_multiple,"
                  "irrelevance --artifact model.gguf --limit 50 --max-new-tokens 256")
def evaluate_agent(
    tasks: Optional[Path] = typer.Argument(None, help="Task rows with prompt and answer, or function "
                                                      "rows with tools and ground_truth (jsonl, json, "
                                                      "csv, parquet, datasets); or --bfcl."),
    artifact: list[Path] = typer.Option(..., "--artifact", help="Exported model (.gguf or ONNX "
                                        "directory), a base with its adapters (BASE.gguf+ADAPTER.gguf), "
                                        "an adapter export's manifest (adapter-*.gguf.json) or a bundle "
                                        "folder; repeat to compare: each is compared with the first."),
    bfcl: Optional[str] = typer.Option(None, "--bfcl", help="Instead of a task file, BFCL v4's own "
                                       "entries of these categories (comma-separated: simple_python, "
                                       "multiple, parallel, parallel_multiple, irrelevance), from the "
                                       "package bfcl-eval, scored by BFCL's AST rules."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use the first N tasks only "
                                        "(with --bfcl: of each category)."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", min=1, help="Most tokens per model reply."),
    max_tool_rounds: int = typer.Option(3, "--max-tool-rounds", help="Tool rounds an episode may "
                                        "take before its final answer (an integer >= 0)."),
    samples: int = typer.Option(1, "--samples", help="Episodes per task (an integer >= 1): 1 "
                                "answers greedily; k > 1 samples k at --temperature and "
                                "adds pass@k and pass@1."),
    temperature: float = typer.Option(0.7, "--temperature", help="Temperature of sampled episodes "
                                      "(--samples > 1), a number from 0 to 2."),
    seed: int = typer.Option(0, "--seed", help="Seed of the samples (each episode's is drawn from "
                             "it, the task and the sample) and of the bootstrap intervals."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the full report "
                                                           "(per-episode results) here."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file (never an "
                                                              "input)."),
    batch: int = typer.Option(8, "--batch", help="Episodes of a GGUF model decoded together in one "
                              "llama.cpp context (continuous batching; the same results as 1, one at "
                              "a time). ONNX models run one at a time."),
    call_threshold: Optional[float] = CallThresholdOpt,
    chat_template: Optional[str] = ChatTemplateOpt,
    threads: Optional[int] = ThreadsOpt,
    as_json: bool = JsonFlag,
) -> None:
    """Run exported models in the agent runtime, with real tools, on held-out tasks:
    success with its Wilson interval, call and valid-call rates, rounds, tokens and failures
    per model (with --samples k: pass@k and pass@1), and paired bootstrap intervals of the
    success difference. Function rows and --bfcl: calls judged by BFCL's rules, accuracy per
    category."""
    from slm_align.atomic import write_json_atomic
    from slm_align.ondevice.agent.task_eval import evaluate_artifacts
    from slm_align.runs import check_out_file

    if out is not None:  # before any work: a refused --out writes nothing, and never replaces an input
        check_out_file(out, [path for path in (tasks, *artifact) if path is not None], overwrite)
    report = evaluate_artifacts(tasks, artifact, limit=limit, max_tokens=max_new_tokens,
                                max_tool_rounds=max_tool_rounds, seed=seed, samples=samples,
                                temperature=temperature, bfcl=bfcl, threads=threads, batch=batch,
                                call_threshold=call_threshold, chat_template=chat_template)
    if out is not None:
        write_json_atomic(out, report)
    emit(as_json, report, lambda: print_agent_report(report))


@commands.command("choose-call-threshold", epilog="Examples:\n\n  slm-align choose-call-threshold "
                  "data/functions/train.jsonl --artifact rl/model-Q8_0.gguf --limit 200 --out threshold.json")
def choose_call_threshold(
    tasks: Path = typer.Argument(..., help="Function rows that call and irrelevance rows (the training "
                                           "split of the function family has both; never the rows you "
                                           "will judge on)."),
    artifact: Path = typer.Option(..., "--artifact", help="Exported model (.gguf or ONNX directory), a base "
                                  "with its adapters, an adapter export's manifest or a bundle folder."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use the first N rows only."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the report (every row's score and "
                                                           "the whole table) here."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file (never an input)."),
    chat_template: Optional[str] = ChatTemplateOpt,
    threads: Optional[int] = ThreadsOpt,
    as_json: bool = JsonFlag,
) -> None:
    """Choose the call rule's threshold for an exported model (the number evaluate-agent, chat and serve
    take as their call threshold): each row's probability of opening a call under greedy decoding, and
    the threshold that best separates the rows that call from the irrelevance rows (balanced accuracy of
    the decision), with the table around it."""
    from slm_align.atomic import write_json_atomic
    from slm_align.ondevice.agent.call_calibration import choose_call_threshold as choose
    from slm_align.runs import check_out_file

    if out is not None:
        check_out_file(out, [tasks, artifact], overwrite)
    report = choose(tasks, artifact, limit=limit, threads=threads, chat_template=chat_template)
    if out is not None:
        write_json_atomic(out, report)
    emit(as_json, report, lambda: print_threshold_report(report))


def print_threshold_report(report: dict) -> None:
    """The chosen threshold, its rates, and the table at every tenth with the chosen row."""
    table = Table(title=f"Call threshold for {Path(report['artifact']).name} on {report['rows']} rows "
                        f"({report['call_rows']} that call)")
    for column in ("threshold", "call rows that call", "irrelevance rows that decline", "balanced"):
        table.add_column(column, justify="right")
    shown = [row for row in report["table"] if round(row["threshold"] * 10, 6) % 1 == 0]
    shown = sorted([*shown, report], key=threshold_of)
    for row in shown:
        style = "bold" if row is report else None
        table.add_row(f"{row['threshold']:.2f}", f"{row['call_rate']:.3f}", f"{row['decline_rate']:.3f}",
                      f"{row['balanced']:.3f}", style=style)
    stdout.print(table)
    stdout.print(f"chosen: --call-threshold {report['threshold']:.2f} (balanced accuracy {report['balanced']:.3f})")


def threshold_of(row: dict) -> float:
    """A table row's threshold (its sort key)."""
    return row["threshold"]


def _title(report: dict) -> str:
    """The table's title: the tasks, how they were answered, the tool rounds allowed."""
    samples = report.get("samples", 1)
    decoding = "greedy"
    if samples > 1:
        decoding = f"{samples} samples each at temperature {report['temperature']:g}"
    if report.get("call_threshold") is not None:
        decoding += f", calls at P(call) >= {report['call_threshold']:g}"
    rounds = f"up to {report['max_tool_rounds']} tool rounds"
    categories = report["artifacts"][0].get("by_category") if report["artifacts"] else None
    if categories and sum(group["episodes"] for group in categories.values()) == report["artifacts"][0]["episodes"]:
        rounds = "function rows: calls judged, none run"
    return f"Agent tasks ({report['n_tasks']} tasks, {decoding}, {rounds})"


def artifact_labels(artifacts: list[str]) -> list[str]:
    """Each artifact's file name, or its folder and name where two share a name (exports are all
    called ``model-<quant>.gguf``)."""
    names = [Path(artifact).name for artifact in artifacts]
    return [name if names.count(name) == 1 else f"{Path(artifact).parent.name}/{name}"
            for artifact, name in zip(artifacts, names)]


def _interval(value: float, ci95: list) -> str:
    """A rate over its 95% interval, on two lines: ``0.40`` then ``[0.12, 0.77]``."""
    return f"{value:.2f}\n[{ci95[0]:.2f}, {ci95[1]:.2f}]"


def top_failures(row: dict, top: int = TOP_FAILURES) -> str:
    """The commonest failure categories with count and share, one a line (``no call 3 (60%)``);
    "none"."""
    counts = row["failures"]
    ranked = sorted((name for name in counts if counts[name]), key=lambda name: -counts[name])
    shares = row["failure_shares"]
    return "\n".join(f"{FAILURE_LABELS.get(name, name)} {counts[name]} ({shares[name]:.0%})"
                     for name in ranked[:top]) or "none"


def _columns(samples: int) -> list[str]:
    """The headers: success when greedy, pass@k and pass@1 when sampled; then the call figures."""
    rates = ["success\n[95% CI]"]
    if samples > 1:
        rates = [f"pass@{samples}\n[95% CI]", "pass@1\n[95% CI]"]
    return ["artifact", *rates, "call\nrate", "valid\ncalls", "rounds\n/task", "tokens\n/task",
            "top failures"]


def _row(label: str, row: dict, samples: int) -> list[str]:
    """One artifact's cells, in the order of :func:`_columns`."""
    rates = [_interval(row["success_rate"], row["success_ci95"])]
    if samples > 1:
        rates = [_interval(row["pass_at_k"], row["pass_at_k_ci95"]),
                 _interval(row["pass_at_1"], row["pass_at_1_ci95"])]
    valid = "-" if row["valid_call_rate"] is None else f"{row['valid_call_rate']:.2f}"
    return [label, *rates, f"{row['call_rate']:.2f}", valid, f"{row['rounds_per_task']:.2f}",
            f"{row['tokens_per_task']:.1f}", top_failures(row)]


def print_agent_report(report: dict) -> None:
    """One row per artifact (success [95% CI] when greedy, pass@k and pass@1 [95% CI] when
    sampled; call rate, valid-call rate, rounds and tokens per episode, the commonest
    failures), then one verdict line per comparison."""
    samples = report.get("samples", 1)
    caption = None
    if samples > 1:
        caption = ("intervals: bootstrap over tasks; the other figures over all "
                   f"{report['n_tasks'] * samples} episodes")
    table = Table(title=_title(report), caption=caption)
    for column in _columns(samples):
        table.add_column(column, overflow="fold")  # a long artifact name wraps, never cut short
    artifacts = [row["artifact"] for row in report["artifacts"]]
    labels = dict(zip(artifacts, artifact_labels(artifacts)))
    for row in report["artifacts"]:
        table.add_row(*_row(labels[row["artifact"]], row, samples))
    stdout.print(table)
    print_categories(report, labels)
    for row in report["artifacts"]:
        if "tools_shown" in row:
            stdout.print(f"tools shown to {labels[row['artifact']]} by: {row['tools_shown']}")
        if row.get("truncated"):
            stdout.print(f"{labels[row['artifact']]}: {row['truncated']} of {row['episodes']} replies stopped at "
                         f"--max-new-tokens {report['max_tokens']}, their calls cut short; judge with more tokens")
    figure = "success" if samples == 1 else "pass@1"
    for comparison in report["comparisons"]:
        pairs = [("", comparison), *(comparison.get("by_category") or {}).items()]
        for category, delta in pairs:
            low, high = delta["ci95"]
            stdout.print(f"{labels[comparison['candidate']]} vs {labels[comparison['baseline']]}"
                         f"{' on ' + category if category else ''}: {figure} {delta['success_delta']:+.3f} "
                         f"(95% CI {low:+.3f} to {high:+.3f}): {delta['verdict']}")


def print_categories(report: dict, labels: dict) -> None:
    """Function rows: accuracy [Wilson 95% CI] per category (rows) and artifact (columns)."""
    rows = [row for row in report["artifacts"] if row.get("by_category")]
    if not rows:
        return
    table = Table(title="Function calling by category (BFCL's rules)")
    table.add_column("category")
    for row in rows:
        table.add_column(f"{labels[row['artifact']]}\naccuracy [95% CI]", overflow="fold")
    for category, first in rows[0]["by_category"].items():
        cells = [_interval(row["by_category"][category]["accuracy"], row["by_category"][category]["ci95"])
                 for row in rows]
        table.add_row(f"{category} ({first['episodes']})", *cells)
    stdout.print(table)
