"""``slm-align feedback collect``: many devices' feedback merged into the next round's rows.

Inputs are devices' preference stores and ``feedback export`` files
(:mod:`~slm_align.ondevice.agent.feedback_sources`). Every row kept is consented (stores: turns with
consent only; export files hold nothing else), scrubbed again
(:func:`~slm_align.ondevice.agent.feedback_export.scrub_row`, whatever the device did), counted once
per device and turn (the same verdict on the same turn, sent twice or stored 10,000 times, is one
row), and capped per device (``max_rows_per_device``, first come first kept: one device cannot make
a round). Each row keeps its provenance: ``device``, ``model_id``, ``arm``.

Output folder ``OUT``: ``pairs.jsonl`` (DPO: prompt, chosen, rejected), ``unpaired.jsonl`` (KTO:
prompt, completion, label), ``tasks.jsonl`` (each thumbs-rated turn as a task with its outcome:
prompt, the reply as messages, its calls, the tools' results, outcome 1 or 0;
:mod:`~slm_align.ondevice.agent.feedback_tasks`) and ``demonstrations.jsonl`` (the task rows rated
up as SFT chats, ``messages`` and ``tools``: what ``slm-align sft`` reads as ``data.path``),
always; with pyarrow (``slm-align[train]``; optional, so the device wing stays light) the pairs,
unpaired and task rows as Parquet shards ``pairs/part-00000.parquet``... of at most ``shard_rows``
rows each, with one fixed schema per kind (each message: role, content, and its tool calls as JSON
text; the offered ``tools`` and a task's ``calls`` as JSON text); ``summary.json``. A task row and
its demonstration ride with their thumbs row: one verdict, so the dedupe and the cap that keep or
drop the verdict keep or drop them, and a device's cap counts verdicts.

Streaming: stores are read through SQL cursors, rows are written as they come (a Parquet shard is
the most held), and the (device, turn) dedupe lives in an on-disk SQLite index, so memory does not
grow with the number of rows or stores (a test measures it). Everything is written into a scratch
folder beside ``OUT`` and renamed into place at the end: an earlier ``OUT`` is only replaced with
``overwrite``.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from slm_align.atomic import building_directory
from slm_align.errors import UserError
from slm_align.ondevice.agent.feedback_export import scrub_row
from slm_align.ondevice.agent.feedback_sources import Candidate, NotFeedback, read_input
from slm_align.ondevice.agent.feedback_tasks import demonstration, task_row
from slm_align.ondevice.agent.scrub import detectors
from slm_align.runs import check_out_dir

try:  # optional: the device wing installs without it; Parquet shards need it (slm-align[train])
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - exercised where pyarrow is absent
    pa = None
    pq = None

DEFAULT_MAX_ROWS_PER_DEVICE = 1000
"""A device's most rows in one round: a thousand devices make a round, no one of them dominates
it."""
DEFAULT_SHARD_ROWS = 50_000
KINDS = {"pairs": ("chosen", "rejected"), "unpaired": ("completion",), "tasks": ("completion",),
         "demonstrations": ()}
"""Each kind of row and its answer columns (lists of messages besides ``prompt``)."""
MESSAGE_COLUMNS = ("prompt", "chosen", "rejected", "completion")
JSON_COLUMNS = ("tools", "calls")
"""Columns of any JSON value, written to Parquet as JSON text (None when empty)."""
PARQUET_KINDS = ("pairs", "unpaired", "tasks")


def _message_type():
    return pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string())])


def parquet_schema(kind: str):
    """The one schema of a kind's shards (so ``datasets`` reads every shard as one table)."""
    messages = pa.list_(_message_type())
    answer_columns = [(name, messages) for name in KINDS[kind]]
    label = [("label", pa.bool_())] if kind == "unpaired" else []
    if kind == "tasks":
        result = pa.struct([("name", pa.string()), ("content", pa.string())])
        report = pa.struct([("call", pa.int64()), ("ok", pa.bool_()), ("content", pa.string())])
        label = [("calls", pa.string()), ("results", pa.list_(result)),
                 ("reported", pa.list_(report)), ("outcome", pa.int8())]
    return pa.schema([("prompt", messages), *answer_columns, *label, ("model_id", pa.string()),
                      ("device", pa.string()), ("arm", pa.string()), ("tools", pa.string())])


def _flat_message(message: dict) -> dict:
    """A message in the shards' schema: role, content as text, tool calls as JSON text (None
    without)."""
    content = message.get("content")
    calls = message.get("tool_calls")
    return {"role": str(message.get("role")),
            "content": content if isinstance(content, str) or content is None else json.dumps(content),
            "tool_calls": json.dumps(calls, ensure_ascii=False) if calls else None}


def _flat_row(row: dict) -> dict:
    """A row in the shards' schema: messages flattened, the offered tools and a task's calls as
    JSON text (None without)."""
    flat = {key: [_flat_message(m) for m in value] if key in MESSAGE_COLUMNS else value
            for key, value in row.items() if key not in JSON_COLUMNS}
    for key in JSON_COLUMNS:
        flat[key] = json.dumps(row[key], ensure_ascii=False) if row.get(key) else None
    return flat


class _Shards:
    """A kind's rows written as they come: one JSONL file, and Parquet shards of ``shard_rows``."""

    def __init__(self, folder: Path, kind: str, shard_rows: int, parquet: bool):
        self.folder = folder
        self.kind = kind
        self.shard_rows = shard_rows
        self.parquet = parquet
        self.jsonl: TextIO = open(folder / f"{kind}.jsonl", "w", encoding="utf-8")
        self.buffer: list[dict] = []
        self.shards: list[str] = []
        self.rows = 0

    def add(self, row: dict) -> None:
        self.jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.rows += 1
        if self.parquet:
            self.buffer.append(_flat_row(row))
            if len(self.buffer) >= self.shard_rows:
                self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next shard."""
        if not self.buffer:
            return
        (self.folder / self.kind).mkdir(exist_ok=True)
        name = f"{self.kind}/part-{len(self.shards):05d}.parquet"
        table = pa.Table.from_pylist(self.buffer, schema=parquet_schema(self.kind))
        pq.write_table(table, self.folder / name)
        self.shards.append(name)
        self.buffer = []

    def close(self) -> None:
        self.flush()
        self.jsonl.close()


class _Seen:
    """The (device, turn) keys already kept, in an on-disk SQLite index (bounded memory)."""

    def __init__(self, path: Path):
        self.conn = sqlite3.connect(path)
        self.conn.execute("PRAGMA journal_mode = OFF")
        self.conn.execute("PRAGMA synchronous = OFF")
        self.conn.execute("CREATE TABLE seen (device TEXT, turn TEXT, PRIMARY KEY (device, turn)) WITHOUT ROWID")

    def first(self, candidate: Candidate) -> bool:
        """Whether this is the first time the device's verdict on this turn is seen (and remember
        it)."""
        inserted = self.conn.execute("INSERT OR IGNORE INTO seen VALUES (?, ?)", (candidate.device, candidate.key))
        return inserted.rowcount == 1

    def close(self) -> None:
        self.conn.close()


class _Collector:
    """Consented, scrubbed, deduplicated, capped rows of many inputs into the kinds of
    :data:`KINDS`."""

    def __init__(self, folder: Path, max_rows_per_device: int, shard_rows: int, parquet: bool):
        self.max_rows = max_rows_per_device
        self.shards = {kind: _Shards(folder, kind, shard_rows, parquet and kind in PARQUET_KINDS)
                       for kind in KINDS}
        self.seen = _Seen(folder / ".seen.sqlite")
        self.per_device: Counter = Counter()
        self.per_model: Counter = Counter()
        self.counts = Counter(without_consent=0, identical=0, not_feedback_rows=0, duplicates=0, over_cap=0,
                              scrubbed_replacements=0, malformed_tasks=0)
        self.refused: list[dict] = []
        self.tasks: Counter = Counter(up=0, down=0, up_with_calls=0)

    def take(self, candidate: Candidate) -> None:
        if not self.seen.first(candidate):
            self.counts["duplicates"] += 1
            return
        if self.per_device[candidate.device] >= self.max_rows:
            self.counts["over_cap"] += 1
            return
        row, replaced = scrub_row(candidate.row)
        self.counts["scrubbed_replacements"] += replaced
        self.per_device[candidate.device] += 1
        self.per_model[row["model_id"]] += 1
        row = dict(row, device=candidate.device, arm=candidate.arm)
        if "chosen" in row:
            self.shards["pairs"].add(row)
        else:
            self.shards["unpaired"].add(row)
            self._add_task(row, candidate.reported)

    def _add_task(self, row: dict, reported: tuple) -> None:
        """A kept thumbs row's task row (with what the app reported of running its calls, scrubbed),
        and its demonstration when it was rated up."""
        reported, replaced = scrub_row({"reported": list(reported)})
        self.counts["scrubbed_replacements"] += replaced
        try:
            task = task_row(row, reported["reported"])
        except (AttributeError, IndexError, KeyError, TypeError):  # calls not in OpenAI's form
            self.counts["malformed_tasks"] += 1
            return
        self.shards["tasks"].add(task)
        self.tasks["up" if task["outcome"] else "down"] += 1
        self.tasks["up_with_calls"] += bool(task["outcome"] and task["calls"])
        chat = demonstration(task)
        if chat is not None:
            self.shards["demonstrations"].add(chat)

    def read(self, path: Path) -> None:
        """Every row of one input; an input that is not feedback is refused (recorded), the rest go
        on."""
        try:
            for candidate in read_input(path, self.counts):
                self.take(candidate)
        except (NotFeedback, OSError) as exc:
            self.refused.append({"input": str(path), "why": str(exc)})

    def close(self) -> None:
        for shards in self.shards.values():
            shards.close()
        self.seen.close()


def _check_out(out: Path, inputs: Sequence[Path], overwrite: bool) -> None:
    check_out_dir(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"--out {out} exists and is not empty; pass --overwrite to replace it or choose another")
    for path in inputs:
        if path.resolve() == out.resolve() or out.resolve() in path.resolve().parents:
            raise UserError(f"input {path} is inside --out {out}; pass another --out")


def collect_feedback(inputs: Sequence[str | Path], out: str | Path,
                     max_rows_per_device: int = DEFAULT_MAX_ROWS_PER_DEVICE,
                     shard_rows: int = DEFAULT_SHARD_ROWS, overwrite: bool = False) -> dict[str, Any]:
    """Merge the feedback of ``inputs`` (stores, export files) into the folder ``out``; returns the
    summary (also written as ``out/summary.json``): inputs, devices, rows per kind, per device and
    per model, what was rejected and why, and the files written. No input yielding a row is a
    UserError, nothing written."""
    inputs = [Path(path) for path in inputs]
    out = Path(out)
    cap = max_rows_per_device
    if not inputs:
        raise UserError("pass at least one preference store or feedback export file to collect")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise UserError(f"--max-rows-per-device must be an integer >= 1, got {cap}")
    _check_out(out, inputs, overwrite)
    with building_directory(out, replace=True) as scratch:
        collector = _Collector(scratch, cap, max(1, shard_rows), parquet=pa is not None)
        try:
            for path in inputs:
                collector.read(path)
        finally:
            collector.close()
        (scratch / ".seen.sqlite").unlink()
        summary = _summary(collector, inputs, cap)
        if not sum(summary["rows"].values()):
            raise UserError(_nothing(summary))
        text = json.dumps(summary, indent=2) + "\n"
        (scratch / "summary.json").write_text(text, encoding="utf-8")
    return dict(summary, out=str(out))


def _nothing(summary: dict) -> str:
    """The one line for a collection that kept no row."""
    if summary["refused"] and len(summary["refused"]) == len(summary["inputs"]):
        first = summary["refused"][0]
        return f"no input is feedback: {first['input']}: {first['why']}; pass preference stores or export files"
    return "no consented feedback in the inputs; collect thumbs, choices or edits on turns whose user gave consent"


def _summary(collector: _Collector, inputs: Sequence[Path], cap: int) -> dict[str, Any]:
    counts = collector.counts
    capped = {device: rows for device, rows in collector.per_device.items() if rows >= cap}
    return {
        "inputs": [str(path) for path in inputs],
        "devices": len(collector.per_device),
        "rows": {kind: shards.rows for kind, shards in collector.shards.items()},
        "per_device": dict(collector.per_device),
        "per_model": dict(collector.per_model),
        "max_rows_per_device": cap,
        "devices_at_cap": sorted(capped),
        "rejected": {key: counts[key] for key in ("without_consent", "duplicates", "over_cap", "identical",
                                                  "not_feedback_rows", "malformed_tasks")},
        "refused": collector.refused,
        "scrubbed_replacements": counts["scrubbed_replacements"],
        "scrubbed_by": detectors(),
        "outcomes": dict(collector.tasks),
        "files": {kind: {"jsonl": f"{kind}.jsonl", "parquet": shards.shards}
                  for kind, shards in collector.shards.items()},
        "parquet": None if pa is not None else "pyarrow is not installed: JSONL only (pip install 'slm-align[train]')",
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """One line per refused input and per kind of row dropped, for the terminal."""
    lines = [f"refused {item['input']}: {item['why']}" for item in summary["refused"]]
    rejected = summary["rejected"]
    reasons = {"without_consent": "turn(s) without consent skipped",
               "duplicates": "duplicate row(s) of a device's turn dropped",
               "over_cap": f"row(s) over the cap of {summary['max_rows_per_device']} per device dropped "
                           f"(devices at the cap: {', '.join(summary['devices_at_cap'][:5])}"
                           f"{', ...' if len(summary['devices_at_cap']) > 5 else ''})",
               "identical": "pair(s) whose two sides are the same text skipped",
               "not_feedback_rows": "line(s) of export files that are not feedback rows skipped",
               "malformed_tasks": "rated answer(s) with unreadable tool calls: no task row"}
    lines += [f"{rejected[key]} {text}" for key, text in reasons.items() if rejected[key]]
    return lines

