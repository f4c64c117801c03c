"""Our BFCL checker against BFCL's own, entry by entry: do the two verdicts agree?

    python benchmarks/bfcl.py --official [--categories simple_python,multiple,...] [--limit N]
                              [--report agent-report.json] [--venv /tmp/bfcl-official] [--wheel PATH] [--json]

``evaluate-agent --bfcl`` and the ``function_call_match`` reward judge calls with
:mod:`slm_align.ondevice.rewards.function_match`, a re-implementation of bfcl-eval's
``eval_checker/ast_eval/ast_checker.py``. ``--official`` runs bfcl-eval's own checker on the same replies
in a virtual environment of its own (bfcl-eval pins numpy 1.26 and twenty API clients that clash with
ours): ``python -m venv VENV`` and ``pip install --no-deps bfcl-eval==2026.3.23`` (or ``--wheel``), nothing
else. The checker module itself needs only the standard library and bfcl-eval's constant modules, but it
imports ``MODEL_CONFIG_MAPPING`` from ``bfcl_eval.constants.model_config``, which imports every model
handler (openai, anthropic, cohere, mistralai, google-genai, boto3, qwen-agent, sentence-transformers and
torch ...) only to read one flag, ``underscore_to_dot``, of the model named; the runner reads that flag
for BFCL's OpenAI function-calling model (``gpt-4o-2024-11-20-FC``) from model_config.py's text and puts a
one-entry mapping in its place. The verdict is then BFCL's evaluation path: ``is_empty_output`` for
irrelevance (right when no call), else ``is_function_calling_format_output`` and ``ast_checker`` (both
helpers cut from bfcl-eval's utils.py, whose module imports filelock and more).

The replies: without ``--report``, synthetic ones for every entry of the categories (the ground truth's
first allowed values as calls, the same in reverse order, and perturbed: wrong type, wrong value, a
restyled string, an int for a float, a missing or an extra argument, a wrong name, one call less, no
call; for irrelevance no call and a call; see bfcl_outputs.py); with ``--report``, the replies of an
``evaluate-agent --bfcl ... --out`` report, read by the runtime's parser. Prints the agreement per
category and per kind of reply, and every disagreement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_outputs import variants  # noqa: E402

from slm_align.ondevice.agent.bfcl import CATEGORIES, load_bfcl, parse_categories  # noqa: E402
from slm_align.ondevice.rewards.function_calls import reply_calls  # noqa: E402
from slm_align.ondevice.rewards.function_match import check_calls  # noqa: E402

PACKAGE = "bfcl-eval==2026.3.23"
RUNNER = Path(__file__).resolve().parent / "bfcl_official_runner.py"


def official_python(venv: Path, wheel: str | None) -> Path:
    """The venv's interpreter, the venv made and bfcl-eval installed (--no-deps) when missing."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; assert u.find_spec('bfcl_eval')"],
                           capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", wheel or PACKAGE], check=True)
    return python


def synthetic_replies(rows: list[dict]) -> list[dict]:
    """Every variant of every entry: ``{key, kind, row, calls}``."""
    items = []
    for index, row in enumerate(rows):
        for kind, calls in variants(row).items():
            items.append({"key": f"{row['id']}:{kind}", "kind": kind, "row": index, "calls": calls})
    return items


def report_replies(report_path: Path) -> tuple[list[dict], list[dict]]:
    """The rows and the replies of an ``evaluate-agent --bfcl`` report (each artifact's)."""
    report = json.loads(report_path.read_text(encoding="utf-8"))
    results = [(artifact["artifact"], result) for artifact in report["artifacts"] for result in artifact["results"]]
    counts = Counter(result["group"] for _, result in results if result["sample"] == 0)
    categories = list(dict.fromkeys(result["group"] for _, result in results))
    rows = load_bfcl(categories, max(counts.values()) // len(report["artifacts"]))
    items = []
    for artifact, result in results:
        assert rows[result["task"]]["category"] == result["group"], "the report's tasks are not these BFCL rows"
        items.append({"key": f"{rows[result['task']]['id']}:{Path(artifact).name}:{result['sample']}",
                      "kind": Path(artifact).name, "row": result["task"], "calls": reply_calls(result["reply"])})
    return rows, items


def official_verdicts(python: Path, rows: list[dict], items: list[dict]) -> dict[str, dict]:
    """BFCL's verdict on each reply, by key, from the runner in its own venv."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "replies.jsonl"
        with path.open("w", encoding="utf-8") as handle:
            for item in items:
                row = rows[item["row"]]
                handle.write(json.dumps({"key": item["key"], "category": row["category"], "functions": row["functions"],
                                         "ground_truth": row["ground_truth"], "calls": item["calls"]}) + "\n")
        done = subprocess.run([str(python), str(RUNNER), str(path)], capture_output=True, text=True, check=True)
    return {verdict["key"]: verdict for verdict in map(json.loads, done.stdout.splitlines())}


def compare(rows: list[dict], items: list[dict], official: dict[str, dict] | None) -> dict:
    """Ours (and BFCL's) verdict per reply; agreement by category and by kind of reply."""
    by_category: dict[str, Counter] = {}
    by_kind: dict[str, Counter] = {}
    disagreements = []
    for item in items:
        row = rows[item["row"]]
        ours = check_calls(item["calls"], row["ground_truth"], row["functions"], row["category"])
        for table, key in ((by_category, row["category"]), (by_kind, item["kind"])):
            counts = table.setdefault(key, Counter())
            counts["replies"] += 1
            counts["ours_valid"] += ours.ok
            if official is not None:
                theirs = official[item["key"]]
                counts["bfcl_valid"] += theirs["valid"]
                counts["agree"] += theirs["valid"] == ours.ok
        if official is not None and official[item["key"]]["valid"] != ours.ok:
            disagreements.append({"key": item["key"], "ours": ours.ok, "ours_reason": ours.reason,
                                  "bfcl": official[item["key"]]})
    total = sum(counts["replies"] for counts in by_category.values())
    agree = sum(counts["agree"] for counts in by_category.values()) if official is not None else None
    return {"entries": len(rows), "replies": total, "agree": agree,
            "agreement": None if agree is None else agree / total,
            "by_category": {k: dict(v) for k, v in by_category.items()},
            "by_kind": {k: dict(v) for k, v in by_kind.items()}, "disagreements": disagreements}


def print_summary(summary: dict) -> None:
    official = summary["agree"] is not None
    header = f"{'':22} {'replies':>8} {'ours ok':>8}" + (f" {'BFCL ok':>8} {'agree':>8}" if official else "")
    for title in ("by_category", "by_kind"):
        print(f"\n{title.replace('_', ' ')}\n{header}")
        for name, counts in summary[title].items():
            line = f"{name:22} {counts['replies']:8d} {counts['ours_valid']:8d}"
            if official:
                line += f" {counts['bfcl_valid']:8d} {counts['agree']:8d}"
            print(line)
    if official:
        print(f"\nagreement: {summary['agree']}/{summary['replies']} replies ({summary['agreement']:.4f}) "
              f"over {summary['entries']} BFCL entries")
        for item in summary["disagreements"]:
            print(f"  differs: {item['key']}: ours {item['ours']} ({item['ours_reason']}), BFCL {item['bfcl']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", action="store_true", help="Also run bfcl-eval's own checker and compare.")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--limit", type=int, default=None, help="Entries per category (default: all).")
    parser.add_argument("--report", type=Path, default=None, help="Replies of an evaluate-agent --bfcl report.")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "bfcl-official")
    parser.add_argument("--wheel", default=None, help=f"Install this instead of {PACKAGE} from PyPI.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.report is not None:
        rows, items = report_replies(args.report)
    else:
        rows = load_bfcl(parse_categories(args.categories), args.limit)
        items = synthetic_replies(rows)
    official = official_verdicts(official_python(args.venv, args.wheel), rows, items) if args.official else None
    summary = compare(rows, items, official)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["agree"] in (None, summary["replies"]) else 1


if __name__ == "__main__":
    sys.exit(main())
