"""Where ``feedback collect`` reads a fleet's feedback from, one row at a time: a device's preference store
(SQLite, read-only through a cursor: nothing is loaded whole and the file is never migrated or written), or
the JSONL files ``feedback export`` wrote on a device.

Each input yields :class:`Candidate` rows: the TRL row (``feedback_export``'s pair or unpaired row, with
``model_id``), the device it came from, the arm that answered and a key naming the turn's verdict, by
content, so that one turn stored many times, or sent both as a store and as an export, counts once.

The device is the input's file name without its suffixes (``phone-17.db``, ``phone-17.jsonl`` and
``phone-17.unpaired.jsonl`` are one device, ``phone-17``): stores record no device id, so a fleet names
each device's file after it. The arm is the adapters that answered (their file names joined with ``+``,
``base`` for none) as the turn's sampling record names them; rows of an export file carry none.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Optional

from slm_align.ondevice.agent.feedback_export import latest_verdicts, verdict_row
from slm_align.ondevice.agent.store import SQLITE_HEADER, Feedback, Turn

_SHA256 = re.compile(r"[0-9a-f]{64}")
_TURN_COLUMNS = ("id", "conversation_id", "created_at", "model_id", "messages", "completion", "sampling",
                 "consent")
_FEEDBACK_COLUMNS = ("id", "turn_id", "kind", "other_completion", "preferred", "edited_text", "created_at")
_JOINED = (f"SELECT {', '.join('t.' + c for c in _TURN_COLUMNS)}, "
           f"{', '.join('f.' + c for c in _FEEDBACK_COLUMNS)} FROM turns t JOIN feedback f ON f.turn_id = t.id "
           "WHERE t.consent = 1 ORDER BY t.id, f.id")
_WITHOUT_CONSENT = "SELECT COUNT(DISTINCT t.id) FROM turns t JOIN feedback f ON f.turn_id = t.id WHERE t.consent = 0"
MAX_REPORTED_CALLS = 64
"""The calls of one reply whose reported results are read (a store from another writer may hold
any number: a round takes a bounded share of one turn)."""
_RESULTS = ("SELECT call_index, ok, content FROM call_results WHERE turn_id = ? AND call_index < ? "
            "ORDER BY id")


class NotFeedback(Exception):
    """An input that is not a preference store or a feedback export: refused in one line, others go on."""


@dataclass(frozen=True)
class Candidate:
    """One row of the next round, before dedupe and caps."""

    row: dict
    device: str
    arm: Optional[str]
    key: str
    """sha256 of the verdict's question (pair or verdict) and the turn's prompt, answer and model."""
    reported: tuple = ()
    """What the app reported of running the reply's calls (schema version 5): ``{"call", "ok",
    "content"}`` per call, the latest report of each; none from an export file."""


def device_of(path: Path) -> str:
    """The device an input belongs to: its file name up to the first dot."""
    return path.name.split(".", 1)[0]


def turn_key(row: dict) -> str:
    """What makes two rows the same verdict on the same turn: the kind of row, the model, the prompt and
    the model's answer (for a pair, both sides: the turn's answer is one of them)."""
    if "chosen" in row:
        content = ["pair", row["model_id"], row["prompt"], row["chosen"], row["rejected"]]
    else:
        content = ["verdict", row["model_id"], row["prompt"], row["completion"]]
    if row.get("tools"):  # the same words under other tools offered are another turn
        content.append(row["tools"])
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def arm_of(sampling: Any) -> str:
    """The adapters that answered a turn, as its sampling record names them; ``base`` for none."""
    adapters = sampling.get("adapters") if isinstance(sampling, dict) else None
    files = [str(a.get("file")) for a in adapters or () if isinstance(a, dict)]
    return "+".join(files) if files else "base"


def open_store(path: Path) -> sqlite3.Connection:
    """A read-only connection to a preference store; :class:`NotFeedback` for anything else."""
    with open(path, "rb") as handle:
        if handle.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            raise NotFeedback("not a preference store (no SQLite header) nor a feedback export (.jsonl)")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"turns", "feedback"} <= tables:
            raise NotFeedback("an SQLite file without the store's turns and feedback tables: not ours")
        columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
        if not set(_TURN_COLUMNS) <= columns:
            raise NotFeedback("its turns table lacks the store's columns: not ours")
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise NotFeedback(f"an unreadable SQLite file ({exc})") from None
    except NotFeedback:
        conn.close()
        raise
    return conn


def _turn(values: list[tuple]) -> Turn:
    """A turn with its feedback from the joined rows of one turn (one per feedback row)."""
    record = dict(zip(_TURN_COLUMNS, values[0][:len(_TURN_COLUMNS)]))
    return Turn(record["id"], record["conversation_id"], record["created_at"], record["model_id"],
                json.loads(record["messages"]), record["completion"], json.loads(record["sampling"]),
                bool(record["consent"]), tuple(_feedback(v) for v in values))


def _feedback(values: tuple) -> Feedback:
    record = dict(zip(_FEEDBACK_COLUMNS, values[len(_TURN_COLUMNS):]))
    return Feedback(record["id"], record["turn_id"], record["kind"], record["other_completion"],
                    record["preferred"], record["edited_text"], record["created_at"])


def has_results(conn: sqlite3.Connection) -> bool:
    """Whether the store records call results (schema version 5 and later)."""
    found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                         "AND name = 'call_results'")
    return found.fetchone() is not None


def reported_results(conn: sqlite3.Connection, turn_id: int) -> tuple:
    """The app's reports of running the turn's calls, the latest per call, in call order."""
    latest = {call: {"call": call, "ok": bool(ok), "content": content}
              for call, ok, content in conn.execute(_RESULTS, (turn_id, MAX_REPORTED_CALLS))}
    return tuple(latest[call] for call in sorted(latest))


def store_rows(path: Path, counts: dict) -> Iterator[Candidate]:
    """The consented verdicts of a store, turn by turn, read through one cursor; adds the turns without
    consent (``without_consent``) and the pairs whose two sides are the same text (``identical``)."""
    conn = open_store(path)
    device = device_of(path)
    try:
        counts["without_consent"] += conn.execute(_WITHOUT_CONSENT).fetchone()[0]
        results = has_results(conn)
        for _, group in groupby(conn.execute(_JOINED), key=lambda values: values[0]):
            turn = _turn(list(group))
            reported = reported_results(conn, turn.id) if results else ()
            for feedback in latest_verdicts(turn):
                row = verdict_row(turn, feedback)
                if row is None:
                    counts["identical"] += 1
                    continue
                yield Candidate(row, device, arm_of(turn.sampling), turn_key(row), reported)
    except (sqlite3.DatabaseError, ValueError) as exc:
        raise NotFeedback(f"a damaged store ({type(exc).__name__}: {exc})") from None
    finally:
        conn.close()


def _messages(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of chat messages (objects with a text ``role``)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value))


def _export_row(value: Any) -> Optional[dict]:
    """``value`` when it is a row ``feedback export`` writes (a pair or a verdict, with its model_id)."""
    if not isinstance(value, dict) or not isinstance(value.get("model_id"), str):
        return None
    if not _SHA256.fullmatch(value["model_id"]) or not _messages(value.get("prompt")):
        return None
    pair = _messages(value.get("chosen")) and _messages(value.get("rejected"))
    verdict = _messages(value.get("completion")) and isinstance(value.get("label"), bool)
    if not pair and not verdict:
        return None
    keys = ("prompt", "chosen", "rejected", "model_id") if pair else ("prompt", "completion", "label", "model_id")
    tools = {"tools": value["tools"]} if isinstance(value.get("tools"), list) and value["tools"] else {}
    return {**{key: value[key] for key in keys}, **tools}


def export_rows(path: Path, counts: dict) -> Iterator[Candidate]:
    """The rows of a ``feedback export`` file, line by line (rows it wrote are consented); lines that are
    not such rows are counted as ``not_feedback_rows``; a file with none at all is :class:`NotFeedback`."""
    device = device_of(path)
    good = 0
    bad = 0
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                if not line.strip():
                    continue
                try:
                    row = _export_row(json.loads(line))
                except ValueError:
                    row = None
                if row is None:
                    bad += 1
                    continue
                good += 1
                yield Candidate(row, device, None, turn_key(row))
    except UnicodeDecodeError:
        raise NotFeedback("not text: neither a preference store nor a feedback export") from None
    if bad and not good:
        raise NotFeedback(f"none of its {bad} lines is a feedback row (prompt, chosen/rejected or "
                          "completion/label, model_id)")
    counts["not_feedback_rows"] += bad


def read_input(path: Path, counts: dict) -> Iterator[Candidate]:
    """The rows of one input: a store, or a ``.jsonl`` export file; :class:`NotFeedback` otherwise."""
    if not path.is_file():
        raise NotFeedback("not found, or not a file")
    if path.suffix.lower() == ".jsonl":
        return export_rows(path, counts)
    return store_rows(path, counts)
