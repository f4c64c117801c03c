"""What the commands print for people: rich tables and one-line summaries (``--json``
prints the dicts instead)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

stdout = Console()

SKIPPED = "already done with these inputs (skipped)"
FIT_COLORS = {"fits": "green", "tight": "yellow"}


def emit(as_json: bool, result: dict, human: Callable[[], None]) -> None:
    """Print ``result`` as JSON, or call ``human`` to print it for people."""
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
    else:
        human()


def size(num_bytes: float) -> str:
    """Bytes as GiB from 1 GiB up, else as MiB."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.0f} MiB"


def rows_table(title: str, rows: list[dict], whole: tuple[str, ...] = ()) -> Table:
    """A table with one column per key of the rows (underscores shown as spaces); the ``whole``
    columns are never wrapped nor cut (names one types, such as a profile's); the others give way
    on a narrow terminal."""
    table = Table(title=title)
    for column in (rows[0] if rows else {}):
        widest = max(len(str(row[column])) for row in rows)
        table.add_column(column.replace("_", " "), no_wrap=column in whole,
                         min_width=widest if column in whole else None)
    for row in rows:
        table.add_row(*(str(value) for value in row.values()))
    return table


def print_sft(summary: dict) -> None:
    """One line: SFT's steps, losses and trainable parameters."""
    m = summary["metrics"]
    state = SKIPPED if summary["skipped"] else f"{m['steps']} steps"
    stdout.print(f"[bold]SFT[/] -> {summary['dir']}: {state}; train loss {m['train_loss']:.3f}, "
                 f"eval loss {m['eval_loss']:.3f}, "
                 f"{m['trainable_parameters']:,} trainable parameters")


def print_headroom(report: dict) -> None:
    """The headroom gate's figures against their thresholds, the verdict
    and a remedy per failure."""
    info = report["info"]
    stage = info.get("stage", "sft")
    table = Table(title="Headroom gate" if stage == "sft" else f"Headroom gate on the {stage} policy")
    for column in ("figure", "value", "threshold", "result"):
        table.add_column(column)
    for f in report["figures"]:
        table.add_row(f["name"], f"{f['value']:.3f}", f"{f['comparison']} {f['threshold']:g}",
                      "[green]pass[/]" if f["passed"] else "[red]FAIL[/]")
    if "base_ppl" in info:
        table.add_row("base model perplexity (context)", f"{info['base_ppl']:.3f}", "", "")
    if "prior_ppl" in info:
        table.add_row("SFT prior perplexity (context)", f"{info['prior_ppl']:.3f}", "", "")
    for key in ("reward", "reward_accuracy", "reward_spread"):
        if isinstance(info.get(key), str):
            table.add_row(key.replace("_", " "), info[key], "", "")
    spread = info.get("reward_spread")
    if isinstance(spread, dict):
        table.add_row("reward spread between prompts (context)", f"{spread['between']:.3f}", "", "")
        table.add_row(f"prompts with {spread['k']} identical rewards (context)",
                      f"{spread['all_equal_share']:.0%}",
                      "", "")
    stdout.print(table)
    if "measured_as" in info:
        stdout.print(f"measured as {info['measured_as']} (its tasks, reward and settings); nothing written")
    color = "green" if report["passed"] else "red"
    stdout.print(f"verdict: [bold {color}]{report['verdict']}[/]")
    if "recommendation" in info:
        stdout.print(f"advice: {info['recommendation']['why']}")
    for reason, remedy in zip(report["reasons"], report["remedies"]):
        stdout.print(f"  {reason}: {remedy}")


def print_rl(summary: dict) -> None:
    """One line: the RL iterations, held-out reward before and after, guard skips and rollbacks; a
    second one saying which iteration's adapter was published."""
    from slm_align.envelope.watchdog_text import published_line

    m = summary["metrics"]
    state = SKIPPED if summary["skipped"] else f"{m['steps']} iterations"
    forced = " (gate FAIL overridden by --force)" if m["gate"]["forced"] else ""
    stdout.print(f"[bold]RL ({m['algo']})[/] -> {summary['dir']}: {state}{forced}; held-out reward "
                 f"{m['heldout_reward_sft']:.3f} (SFT) -> {m['heldout_reward_rl']:.3f} (RL), delta "
                 f"{m['heldout_reward_delta']:+.3f}; guard skips {m['guard']['skipped']}, "
                 f"rollbacks {m['guard']['rollbacks']}")
    published = published_line(m.get("watchdog"))
    if published is not None:
        stdout.print(published, markup=False, highlight=False)


def print_preference(summary: dict) -> None:
    """One line: the DPO/KTO steps, held-out preference accuracy before and after (with
    its interval), rollbacks."""
    m = summary["metrics"]
    state = SKIPPED if summary["skipped"] else f"{m['steps']} steps on {m['train_items']} items"
    forced = " (gate FAIL overridden by --force)" if m["gate"]["forced"] else ""
    line = f"[bold]{m['algo'].upper()}[/] -> {summary['dir']}: {state}{forced}"
    headline = m["heldout_accuracy"]
    if headline is not None:
        kind = headline["kind"]
        low, high = headline["ci95"]
        line += (f"; held-out {kind.replace('_', ' ')} {m['heldout_before'][kind]:.3f} -> "
                 f"{headline['value']:.3f} [{low:.3f}, {high:.3f}]")
    stdout.print(f"{line}; rollbacks {m['guard']['rollbacks']}")


def print_reward(summary: dict) -> None:
    """One line: the reward model's held-out accuracy (per corruption kind) and mean margin."""
    m = summary["metrics"]
    state = SKIPPED if summary["skipped"] else f"{m['steps']} steps"
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in m["accuracy_by_kind"].items())
    stdout.print(f"[bold]reward model[/] -> {summary['dir']}: {state}; held-out accuracy "
                 f"{m['accuracy']:.3f} ({kinds}) on {m['pairs']} pairs, mean margin "
                 f"{m['mean_margin']:.2f}")


def print_evaluation(report: dict, path: Path) -> None:
    """A row per policy, a line per comparison, and where the report was written."""
    from slm_align.evaluate.stage import summary_line

    table = Table(title=f"Evaluation on {report['prompts']} held-out prompts")
    for column in ("policy", "PPL", "reward mean",
                   "reward std", "distinct-2", "length", "truncated"):
        table.add_column(column)
    for r in report["policies"]:
        table.add_row(r["name"], f"{r['ppl']:.3f}", f"{r['reward_mean']:.3f}", f"{r['reward_std']:.3f}",
                      f"{r['distinct_2']:.3f}", f"{r['length']:.1f}", f"{r['truncated_frac']:.0%}")
    stdout.print(table)
    for comparison in report["comparisons"]:
        stdout.print(summary_line(comparison))
    stdout.print(f"report: {path}")


def print_merge(summary: dict) -> None:
    """One line: the merged directory, its architecture and parameter count."""
    m = summary["metrics"]
    template = " (ChatML chat template added)" if m["default_chat_template"] else ""
    stdout.print(f"[bold]merged[/] -> {summary['dir']}: {m['architecture']}, "
                 f"{m['parameters']:,} parameters"
                 + template)


def print_export(summary: dict) -> None:
    """The artifact's size and time, then the verification against PyTorch."""
    from slm_align.export.publishing.parity import verification_summary

    m = summary["metrics"]
    stdout.print(f"[bold]export[/] -> {summary['dir']}: {m['target']} {m['quant']}, "
                 f"{m['bytes'] / 1e6:.1f} MB, {m['export_seconds']:.1f} s")
    modelfile = m.get("modelfile")
    if modelfile is not None:
        stdout.print(f"Ollama: [bold]{modelfile['path']}[/] beside it (ollama create NAME -f "
                     f"{modelfile['path']})")
        if modelfile["note"]:
            stdout.print(modelfile["note"], style="yellow", highlight=False, markup=False)
    v = m["verification"]
    if v.get("skipped"):
        stdout.print("verification: [yellow]skipped (--no-verify)[/]")
        return
    verdict = "[green]passed[/]" if v["passed"] else "[red]FAILED (published with --force)[/]"
    stdout.print(f"verification {verdict}: {verification_summary(v)}")


def print_feedback_export(result: dict, scrubbed: bool) -> None:
    """One line: the pairs and rated answers written, turns skipped without
    consent, details scrubbed."""
    by = " + ".join(result.get("scrubbed_by", []))
    scrub = f"; {result['scrubbed_replacements']} personal details scrubbed ({by})" if scrubbed else ""
    stdout.print(f"[bold]feedback[/] -> {result['out']} ({result['pairs']} pairs), "
                 f"{result['unpaired_out']} ({result['unpaired']} rated answers); "
                 f"{result['skipped_without_consent']} turns without consent skipped" + scrub)


def print_fleet_ab(result: dict) -> None:
    """One line: the fleet's A/B decision and what it rests on."""
    evidence = result["evidence"]
    stdout.print(f"[bold]A/B[/] {result['decision']}: candidate {result['candidate_id'][:12]} against "
                 f"{result['current_id'][:12]} over {result['devices']} devices, {evidence['conversations']} "
                 f"conversations ({evidence['capped']} over a cap); discordant pairs won "
                 f"{evidence['candidate_wins']} to {evidence['current_wins']}")


def print_serving(info: dict) -> None:
    """One line: the model served and where."""
    key = ", key required" if info["api_key"] else ""
    stdout.print(f"[bold]serving[/] {info['model']} at {info['url']} (API at "
                 f"{info['url']}v1{key}); Ctrl-C stops")


def print_device(profile: dict) -> None:
    """One device profile, then its reference decode measurements."""
    table = Table(title=f"{profile['display_name']} ({profile['name']})", show_header=False)
    for key, value in profile.items():
        if key not in ("reference", "name", "display_name"):
            table.add_row(key.replace("_", " "), ", ".join(value) if isinstance(value, list) else str(value))
    stdout.print(table)
    rows = [{k: p[k] for k in ("model", "quant", "tokens_per_second", "context", "runtime", "source")}
            for p in profile["reference"]]
    stdout.print(rows_table("Reference decode measurements",
                            rows) if rows else "no reference measurements")


def print_fit(report: dict) -> None:
    """Memory by part against the app budget, the verdict, the largest
    context and the decode speed."""
    memory = report["memory"]
    color = FIT_COLORS.get(report["verdict"], "red")
    table = Table(title=f"{report['model']} on {report['device']}", show_header=False)
    for label, value in (
            ("weights", f"{size(memory['weights'])} ({report['quant']})"),
            ("KV cache", f"{size(memory['kv_cache'])} at {report['context']} tokens"),
            ("runtime overhead", size(memory["compute"] + memory["fixed"])),
            ("total / app budget", f"{size(memory['total'])} / {size(report['budget_bytes'])} "
                                   f"({report['share_of_budget']:.0%})"),
            ("verdict", f"[bold {color}]{report['verdict']}[/]"),
            ("largest context that fits", str(report["max_context"])),
            ("recommended quantization", report["recommended_quant"] or "none fits"),
            ("decode speed", f"~{report['tokens_per_second']:.1f} tokens/s (efficiency "
                             f"{report['efficiency']['value']:.2f}, "
                             f"{report['efficiency']['basis']})")):
        table.add_row(label, value)
    stdout.print(table)
    for note in report["notes"]:
        stdout.print(f"note: {note}")


def _bench_rows(b: dict) -> tuple[tuple[str, str], ...]:
    host = b["host"]
    return (
        ("host", f"{host['cpu']}, {host['cores']} cores, {host['ram_gb']:.1f} GiB, "
                 f"{' '.join(host['isa']) or 'no SIMD flags found'}"),
        ("threads / context", f"{b['threads']} / {b['n_ctx']} tokens"),
        ("load", f"{b['load_seconds'] * 1000:.0f} ms"),
        ("time to first token", f"{b['time_to_first_token_seconds'] * 1000:.0f} ms "
                  f"({b['prompt_tokens']}-token prompt)"),
        ("prompt processing", f"{b['prompt_tokens_per_second']:.1f} tokens/s"),
        ("decode", f"{b['decode_tokens_per_second']:.1f} tokens/s (median of {b['repeats']}, "
                   f"{b['decode_tokens']} tokens each)"),
        ("peak memory (RSS)",
         f"{size(b['peak_rss_bytes'])} ({size(b['rss_before_load_bytes'])} before "
                              f"loading, +{size(b['model_rss_bytes'])} for the model)"))


def print_bench(summary: dict) -> None:
    """The measurements on this host, the device prediction they compare with,
    and any profile saved."""
    b = summary["bench"]
    table = Table(title=f"{b['model']} ({b['kind']}, {b['runtime']})", show_header=False)
    for label, value in _bench_rows(b):
        table.add_row(label, value)
    stdout.print(table)
    p = summary["prediction"]
    if p:
        stdout.print(f"prediction for {p['device']} ({p['quant']}, {p['context']} tokens): "
                     f"~{p['predicted_tokens_per_second']:.1f} tokens/s; measured / "
                     f"predicted = {p['ratio']:.2f}")
    if summary["saved_profile"]:
        saved = summary["saved_profile"]
        stdout.print(f"[bold]saved[/] device profile {saved['name']} -> {saved['path']} (bandwidth "
                     f"{saved['bandwidth_gbs']:.1f} GB/s); use it with --device {saved['name']}")
