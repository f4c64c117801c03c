"""A writer of the preference store that knows only docs/feedback-store.md: plain sqlite3 and the
standard library, nothing from slm_align. It stands in for a Kotlin or Swift app that records
conversations and feedback."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

SPEC = Path(__file__).resolve().parents[1] / "docs" / "feedback-store.md"


def spec_sql() -> str:
    """The SQL block of the spec: the tables of the current schema version and
    its PRAGMA user_version."""
    found = re.search(r"```sql\n(.*?)```", SPEC.read_text(encoding="utf-8"), re.S)
    return found.group(1)


def artifact_digest(path: Path) -> str:
    """The spec's artifact digest of a single-file artifact (a .gguf): sha256 of its bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def open_store(path: Path) -> sqlite3.Connection:
    """A new store made from the spec's SQL, opened the way the spec asks."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript("BEGIN;\n" + spec_sql() + "\nCOMMIT;")
    return conn


def record_turn(conn: sqlite3.Connection, conversation: str, messages: list, completion: str, model_id: str,
                consent: bool) -> int:
    """One answer of the model; returns the turn id."""
    sampling = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 64, "seed": 1}
    cursor = conn.execute(
        "INSERT INTO turns (conversation_id, created_at, model_id, messages, completion, sampling, "
        "consent, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (conversation, now(), model_id, json.dumps(messages), completion, json.dumps(sampling), int(consent),
         secrets.token_urlsafe(24)))
    return cursor.lastrowid


def give_feedback(conn: sqlite3.Connection, turn_id: int, kind: str, other: str | None = None,
                  preferred: str | None = None, edited: str | None = None) -> int:
    """One verdict on a turn (rows are only ever inserted)."""
    cursor = conn.execute(
        "INSERT INTO feedback (turn_id, kind, other_completion, preferred, edited_text, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?)", (turn_id, kind, other, preferred, edited, now()))
    return cursor.lastrowid
