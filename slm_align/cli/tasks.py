"""Tool-use tasks: write the bundled calculator task (``tasks make``) and judge exported models on
task rows in the agent runtime (``evaluate-agent``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from slm_align.cli.options import JsonFlag
from slm_align.cli.render import emit, stdout

commands = typer.Typer()
tasks_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="markdown",
    help="Tool-use task data: the bundled calculator task (SFT chats, RL task rows, held-out "
                        "rows).",
    epilog="Examples:\n\n  slm-align tasks make --out data/calc\n\n"
           "  slm-align tasks make --out data/calc --train 800 --heldout 200 --seed 1 --json")
commands.add_typer(tasks_app, name="tasks")


@tasks_app.command("make", epilog="Examples:\n\n  slm-align tasks make --out data/calc\n\n  "
                                  "slm-align tasks make --out data/calc --train 800 --heldout 200 "
                                  "--seed 1 --json\n\nThen: slm-align train --data "
                                  "data/calc/sft.jsonl ... and slm-align evaluate-agent "
                                  "data/calc/heldout.jsonl --artifact model.gguf")
def tasks_make(
    out: Path = typer.Option(..., "--out", "--output-dir", help="Directory for sft.jsonl, "
                             "train.jsonl and heldout.jsonl."),
    train: int = typer.Option(400, "--train", min=1, help="Training tasks (each gives two SFT "
                              "chats)."),
    heldout: int = typer.Option(100, "--heldout", min=0, help="Held-out tasks for evaluation."),
    seed: int = typer.Option(0, "--seed", help="Generation seed: the same seed writes the same "
                             "files."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace files already in --out."),
    as_json: bool = JsonFlag,
) -> None:
    """Write the bundled calculator task: arithmetic and unit questions, split
    with no shared question."""
    from slm_align.data.agent_tasks import write_agent_tasks

    paths = write_agent_tasks(out, train, heldout, seed, overwrite=overwrite)
    counts = {name: sum(1 for _ in path.open(encoding="utf-8")) for name, path in paths.items()}
    result = {"files": {name: str(path) for name, path in paths.items()}, "rows": counts, "seed": seed}

    def human() -> None:
        for name, path in paths.items():
            stdout.print(f"{name}: {path} ({counts[name]} rows)")

    emit(as_json, result, human)


@commands.command("evaluate-agent", epilog="Examples:\n\n  slm-align evaluate-agent "
                  "data/calc/heldout.jsonl --artifact runs/demo/export/model-Q8_0.gguf\n\n  "
                  "slm-align evaluate-agent data/calc/heldout.jsonl --artifact sft/model-Q8_0.gguf "
                  "--artifact rl/model-Q8_0.gguf --limit 50 --out agent-report.json --json")
def evaluate_agent(
    tasks: Path = typer.Argument(..., help="Task rows with prompt and answer (jsonl, json, csv, "
                                 "parquet, datasets)."),
    artifact: list[Path] = typer.Option(..., "--artifact", help="Exported model (.gguf or ONNX "
                                                               "directory); repeat to compare: "
                                                               "each is compared with the first."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use the first N tasks only."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", min=1, help="Most tokens per model "
                                       "reply."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the full report (per-task "
                                       "results) here."),
    as_json: bool = JsonFlag,
) -> None:
    """Run exported models in the agent runtime, with real tools, on held-out tasks:
    success, valid calls, rounds, tokens and failures per model, and paired bootstrap
    intervals of the success difference."""
    from slm_align.agent.task_eval import evaluate_artifacts
    from slm_align.atomic import write_json_atomic

    report = evaluate_artifacts(tasks, artifact, limit=limit, max_tokens=max_new_tokens)
    if out is not None:
        write_json_atomic(out, report)
    emit(as_json, report, lambda: print_agent_report(report))


def print_agent_report(report: dict) -> None:
    """A table of the artifacts' figures, then one verdict line per comparison."""
    table = Table(title=f"Agent tasks ({report['n_tasks']} tasks)")
    for column in ("artifact", "success", "valid "
                   "calls", "rounds/task", "tokens/task", "no call", "malformed",
                   "wrong tool", "wrong answer"):
        table.add_column(column)
    for row in report["artifacts"]:
        failures = row["failures"]
        valid = "-" if row["valid_call_rate"] is None else f"{row['valid_call_rate']:.2f}"
        table.add_row(Path(row["artifact"]).name, f"{row['success_rate']:.2f}", valid, f"{row['rounds_per_task']:.2f}",
                      f"{row['tokens_per_task']:.1f}", str(failures["no_call"]), str(failures["malformed_call"]),
                      str(failures["wrong_tool"]), str(failures["wrong_answer"]))
    stdout.print(table)
    for comparison in report["comparisons"]:
        low, high = comparison["ci95"]
        stdout.print(f"{Path(comparison['candidate']).name} vs "
                     f"{Path(comparison['baseline']).name}: success "
                     f"{comparison['success_delta']:+.3f} (95% CI {low:+.3f} to {high:+.3f}): "
                     f"{comparison['verdict']}")
