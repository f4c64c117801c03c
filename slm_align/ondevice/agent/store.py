"""The on-device preference store: every turn the model answered and what the user said about it.

One SQLite file in WAL mode with ``synchronous=FULL``: a write returns only once it is durable,
so a turn or a verdict that was committed survives the app being killed. The schema is
versioned with ``PRAGMA user_version`` and brought up to :data:`SCHEMA_VERSION` by
:func:`migrate` when the store opens.

Threads: a store holds ONE connection (``check_same_thread=False``) and serializes every call on a
lock, so a server may share one ``PreferenceStore`` between its threads. Other processes may open
the same file too (WAL lets readers run beside the writer; writers wait up to
:data:`BUSY_TIMEOUT_MS`).

Privacy: the file (and its ``-wal``/``-shm`` companions) is created readable and writable by
the owner only. Feedback rows are appended, never updated: the export takes the latest verdict
(see ``feedback_export``).

Turn tokens: each turn keeps a random token (schema version 2) that whoever was given the answer
presents with feedback on it (:meth:`PreferenceStore.turn_by_token`); ids are sequential and easy to
guess, tokens are not. Turns recorded before version 2 have none and take no token-checked feedback.

A/B decisions: a server A/B-testing a candidate adapter (``serve --candidate``) records each decision it
reaches, with its evidence, in ``ab_decisions`` (schema version 3; :meth:`PreferenceStore.record_decision`);
the trials and the turns each routed are in ``ab_trials`` and ``ab_turns`` (schema version 4; see
:mod:`slm_align.ondevice.agent.store_ab`).

Call results: an app that runs a reply's calls itself reports whether each worked in
``call_results`` (schema version 5; :meth:`PreferenceStore.report_result`), the turn's outcome
beside the thumbs.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import sqlite3
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from slm_align.errors import UserError
from slm_align.ondevice.agent.store_ab import TrialRecords
from slm_align.ondevice.agent.store_schema import AB_DECISIONS, migrate, schema_version

BUSY_TIMEOUT_MS = 5000
PRIVATE_UMASK = 0o077
PRIVATE_MODE = 0o600
SQLITE_HEADER = b"SQLite format 3\x00"
FEEDBACK_KINDS = ("up", "down", "choice", "edit")
PREFERRED = ("this", "other")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_TURN_ID = 2 ** 63 - 1
"""SQLite's largest integer: a larger id names no turn (and would not fit a query)."""
TOKEN_BYTES = 24
"""Randomness of a turn token (32 URL-safe characters)."""
MAX_FEEDBACK_PER_TURN = 16
"""Most feedback records one turn keeps: a user changes their mind a few times, a client that sends hundreds
(one turn token, 300 distinct alternatives) is refused instead of growing the store."""



@dataclass(frozen=True)
class Feedback:
    """One verdict on a turn."""

    id: int
    turn_id: int
    kind: str                          # 'up' | 'down' | 'choice' | 'edit'
    other_completion: str | None    # 'choice': the other candidate
    preferred: str | None           # 'choice': 'this' (the turn's completion) or 'other'
    edited_text: str | None         # 'edit': the corrected answer
    created_at: str


@dataclass(frozen=True)
class Turn:
    """One answer of the model, with the feedback given on it (oldest first)."""

    id: int
    conversation_id: str
    created_at: str
    model_id: str
    messages: list[dict[str, Any]]
    completion: str
    sampling: dict[str, Any]
    consent: bool
    feedback: tuple[Feedback, ...] = ()
    token: str | None = None
    """What feedback on the turn must present (None: recorded before turn tokens)."""


def new_token() -> str:
    """An unguessable turn token."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@contextmanager
def _private_umask() -> Iterator[None]:
    """Files created inside are owner-only (the umask is per process: keep the block short)."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def _check_is_sqlite(path: Path) -> None:
    """A non-empty file must start with SQLite's header; an empty one SQLite initialises."""
    with open(path, "rb") as f:
        header = f.read(len(SQLITE_HEADER))
    if header and header != SQLITE_HEADER:
        raise UserError(f"preference DB {path} is not a SQLite database; pass the store's "
                        ".db file or a new path")


def _check_regular(path: Path) -> None:
    """Refuse a device, pipe or socket before SQLite opens it (and makes ``PATH-journal`` beside it)."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise UserError(f"preference DB {path} is not a regular file; pass a file path such as prefs.db")


def _make_private(path: Path) -> None:
    """Tighten a store made beforehand (and its ``-wal``/``-shm``, which SQLite creates with the
    database's own mode) to owner-only; a file this user cannot chmod is refused."""
    for each in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if not each.exists() or stat.S_IMODE(each.stat().st_mode) & ~PRIVATE_MODE == 0:
            continue
        try:
            os.chmod(each, PRIVATE_MODE)
        except OSError as e:
            raise UserError(f"preference DB {each} is readable by other users and cannot be made "
                            f"owner-only ({e.strerror}); run chmod 600 on it as its owner") from None


def _create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0o600, unless another process just created it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE))
    except FileExistsError:
        pass


def _connect(path: Path) -> sqlite3.Connection:
    """An autocommit connection (transactions are explicit) in WAL mode with durable commits."""
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        schema_version(conn)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise UserError(f"preference DB {path}: cannot switch to WAL mode (got {mode}); "
                            "put the store on a local file system")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        migrate(conn)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise UserError(f"preference DB {path} is not a readable SQLite database ({e}); "
                        "pass the store's .db file or a new path") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _json_text(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UserError(f"{what} must be JSON-serializable ({e}); "
                        "pass plain numbers, strings, lists and dicts") from None


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise UserError("messages must be a non-empty list of {role, content} dicts with text "
                        "values; pass the chat history the model answered")
    return messages


def _check_model_id(model_id: Any) -> str:
    if not isinstance(model_id, str) or not _SHA256.fullmatch(model_id.lower()):
        raise UserError(f"model_id must be the model artifact's sha256 (64 hex digits), got {model_id!r}; "
                        "hash the .gguf/.onnx file the runtime loaded")
    return model_id.lower()


def _check_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{what} must be non-empty text, got {value!r}")
    return value


def _feedback(row: sqlite3.Row) -> Feedback:
    return Feedback(row["id"], row["turn_id"], row["kind"], row["other_completion"], row["preferred"],
                    row["edited_text"], row["created_at"])


def _turn(row: sqlite3.Row, feedback: tuple[Feedback, ...]) -> Turn:
    return Turn(row["id"], row["conversation_id"], row["created_at"], row["model_id"], json.loads(row["messages"]),
                row["completion"], json.loads(row["sampling"]), bool(row["consent"]), feedback, row["token"])


class PreferenceStore(TrialRecords):
    """Turns and feedback in one SQLite file. Thread-safe: one connection,
    every call under one lock.

    ``create=False`` refuses a missing file instead of making a new store (the export uses it).
    """

    def __init__(self, path: str | os.PathLike, create: bool = True):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._conn = self._open(create)
        self._conn.row_factory = sqlite3.Row

    def _open(self, create: bool) -> sqlite3.Connection:
        if self.path.is_dir():
            raise UserError(f"preference DB {self.path} is a directory; pass a "
                            "file path such as prefs.db")
        if not create and self.path.is_file() and self.path.stat().st_size == 0:  # SQLite would write a schema
            raise UserError(f"preference DB {self.path} is empty (0 bytes), no store the agent wrote; pass the "
                            "file the agent records into")
        if not self.path.exists():
            if not create:
                raise UserError(f"preference DB {self.path} not found; pass the file "
                                "the agent records into")
            if not self.path.parent.is_dir():
                raise UserError(f"preference DB {self.path}: folder {self.path.parent} does not "
                                f"exist; create it first")
            _create_private(self.path)
        _check_regular(self.path)
        _check_is_sqlite(self.path)
        _make_private(self.path)
        with _private_umask():
            return _connect(self.path)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock: committed (durably) on success,
        rolled back on any error."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # -- writes ------------------------------------------------------------------------------------

    def record_turn(self, conversation_id: str, messages: list[dict[str, Any]], completion: str, model_id: str,
                    sampling: dict[str, Any], consent: bool, token: str | None = None) -> int:
        """Store one answer of the model; return its turn id. ``token`` (default: a new one) is what
        feedback on the turn will have to present."""
        if not isinstance(conversation_id, str) or not conversation_id:
            raise UserError(f"conversation_id must be non-empty text, got {conversation_id!r}")
        if not isinstance(completion, str):
            raise UserError(f"completion must be text, got {type(completion).__name__}")
        if not isinstance(sampling, dict):
            raise UserError(f"sampling must be a dict of sampling parameters, got "
                            f"{type(sampling).__name__}")
        row = (conversation_id, _now(), _check_model_id(model_id),
               _json_text(_check_messages(messages), "messages"), completion, _json_text(sampling, "sampling"),
               int(bool(consent)), _check_text(token, "token") if token is not None else new_token())
        with self._transaction() as conn:
            cursor = conn.execute("INSERT INTO turns (conversation_id, created_at, model_id, "
                                  "messages, completion, sampling, consent, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                  row)
            return int(cursor.lastrowid)

    def _add_feedback(self, turn_id: int, kind: str, other_completion: str | None = None,
                      preferred: str | None = None, edited_text: str | None = None) -> int:
        with self._transaction() as conn:
            self._require_turn(conn, turn_id)
            given = conn.execute("SELECT COUNT(*) FROM feedback WHERE turn_id = ?", (turn_id,)).fetchone()[0]
            if given >= MAX_FEEDBACK_PER_TURN:
                raise UserError(f"turn {turn_id} already has {given} pieces of feedback, the most one turn keeps; "
                                "a later verdict cannot be added (the export keeps each turn's latest)")
            cursor = conn.execute("INSERT INTO feedback (turn_id, kind, other_completion, "
                                  "preferred, edited_text, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                                  (turn_id, kind, other_completion, preferred, edited_text, _now()))
            return int(cursor.lastrowid)

    def thumbs(self, turn_id: int, up: bool) -> int:
        """Thumbs up or down on a turn; return the feedback id."""
        return self._add_feedback(turn_id, "up" if up else "down")

    def choose(self, turn_id: int, other_completion: str, preferred: str) -> int:
        """The user compared the turn's completion with ``other_completion``;
        ``preferred`` is 'this' or 'other'."""
        if preferred not in PREFERRED:
            raise UserError(f"preferred must be 'this' or 'other', got {preferred!r}")
        return self._add_feedback(turn_id, "choice", other_completion=_check_text(other_completion, "other_completion"),
                                  preferred=preferred)

    def edit(self, turn_id: int, edited_text: str) -> int:
        """The user rewrote the turn's completion as ``edited_text``."""
        return self._add_feedback(turn_id, "edit", edited_text=_check_text(edited_text, "edited_text"))

    def report_result(self, turn_id: int, ok: bool, content: str | None = None,
                      call: int = 0) -> int:
        """What the app got running call ``call`` (0: the first) of the turn's reply itself:
        ``ok`` and, optionally, what it returned (schema version 5); return the record's id. The
        latest report per call counts; a turn keeps at most :data:`MAX_FEEDBACK_PER_TURN`."""
        if not isinstance(ok, bool):
            raise UserError(f"ok must be True or False (did the call work?), got {ok!r}")
        if isinstance(call, bool) or not isinstance(call, int) or not 0 <= call <= MAX_TURN_ID:
            raise UserError(f"call must be the call's index in the reply (0 the first), "
                            f"got {call!r}")
        if content is not None and not isinstance(content, str):
            raise UserError(f"content must be text or None, got {type(content).__name__}")
        with self._transaction() as conn:
            self._require_turn(conn, turn_id)
            given = conn.execute("SELECT COUNT(*) FROM call_results WHERE turn_id = ?",
                                 (turn_id,)).fetchone()[0]
            if given >= MAX_FEEDBACK_PER_TURN:
                raise UserError(f"turn {turn_id} already has {given} call results, the most one "
                                "turn keeps; report each call once")
            cursor = conn.execute("INSERT INTO call_results (turn_id, call_index, ok, content, "
                                  "created_at) VALUES (?, ?, ?, ?, ?)",
                                  (turn_id, call, int(ok), content, _now()))
            return int(cursor.lastrowid)

    def set_consent(self, target: int | str, consent: bool) -> int:
        """Consent for one turn (``target`` an int turn id) or a whole
        conversation (a str conversation id).

        Returns the number of turns changed; an unknown id is a UserError.
        """
        if isinstance(target, bool) or not isinstance(target, (int, str)):
            raise UserError("set_consent takes a turn id (int) or a conversation "
                            f"id (str), got {target!r}")
        column = "id" if isinstance(target, int) else "conversation_id"
        with self._transaction() as conn:
            changed = conn.execute(f"UPDATE turns SET consent = ? WHERE {column} = ?",
                                   (int(bool(consent)), target)).rowcount
            if changed == 0:
                what = "turn id" if column == "id" else "conversation id"
                raise UserError(f"unknown {what} {target!r} in preference DB {self.path}; "
                                "pass one that record_turn made")
            return changed

    def record_decision(self, current_id: str, candidate_id: str, decision: str, evidence: dict[str, Any]) -> int:
        """Append an A/B test's decision (promote, revert or keep) between two model ids, with its
        evidence (``Evidence.to_dict()``); return its id."""
        if decision not in AB_DECISIONS:
            raise UserError(f"decision must be one of {', '.join(AB_DECISIONS)}, got {decision!r}")
        row = (_now(), _check_model_id(current_id), _check_model_id(candidate_id), decision,
               _json_text(evidence, "evidence"))
        with self._transaction() as conn:
            cursor = conn.execute("INSERT INTO ab_decisions (created_at, current_id, candidate_id, decision, "
                                  "evidence) VALUES (?, ?, ?, ?, ?)", row)
            return int(cursor.lastrowid)

    # -- reads -------------------------------------------------------------------------------------

    def decisions(self, current_id: str, candidate_id: str) -> list[dict[str, Any]]:
        """The A/B decisions recorded between the two model ids, oldest first: ``{id, created_at,
        current_id, candidate_id, decision, evidence}`` each (evidence as a dict)."""
        with self._lock:
            rows = self._conn.execute("SELECT * FROM ab_decisions WHERE current_id = ? AND candidate_id = ? "
                                      "ORDER BY id", (current_id.lower(), candidate_id.lower())).fetchall()
        return [{**dict(row), "evidence": json.loads(row["evidence"])} for row in rows]

    def _require_turn(self, conn: sqlite3.Connection, turn_id: Any) -> None:
        known = (isinstance(turn_id, int) and not isinstance(turn_id, bool) and 0 < turn_id <= MAX_TURN_ID
                 and conn.execute("SELECT 1 FROM turns WHERE id = ?", (turn_id,)).fetchone())
        if not known:
            raise UserError(f"unknown turn id {turn_id!r} in preference DB {self.path}; "
                            "pass an id record_turn returned")

    def turn(self, turn_id: int) -> Turn | None:
        """One turn with its feedback, or None when there is no such turn."""
        if isinstance(turn_id, bool) or not isinstance(turn_id, int) or not 0 < turn_id <= MAX_TURN_ID:
            return None
        found = self._select("WHERE id = ?", (turn_id,))
        return found[0] if found else None

    def turn_by_token(self, turn_id: int, token: Any) -> Turn | None:
        """The turn, if ``token`` is its token; None for an unknown id and a wrong token alike."""
        found = self.turn(turn_id)
        if found is None or found.token is None or not isinstance(token, str):
            return None
        return found if hmac.compare_digest(found.token.encode(), token.encode()) else None

    def turns(self, conversation_id: str | None = None) -> list[Turn]:
        """Every turn (or one conversation's), oldest first, each with its feedback."""
        where, args = ("WHERE conversation_id = ?",
                       (conversation_id,)) if conversation_id is not None else ("", ())
        return self._select(where, args)

    def _select(self, where: str, args: tuple) -> list[Turn]:
        with self._lock:
            rows = self._conn.execute(f"SELECT * FROM turns {where} ORDER BY id", args).fetchall()
            feedback = self._conn.execute(
                f"SELECT * FROM feedback WHERE turn_id IN (SELECT id FROM turns {where}) ORDER BY id",
                                          args).fetchall()
        by_turn: dict[int, list[Feedback]] = {}
        for row in feedback:
            by_turn.setdefault(row["turn_id"], []).append(_feedback(row))
        return [_turn(row, tuple(by_turn.get(row["id"], ()))) for row in rows]

    def counts(self) -> dict[str, int]:
        """``turns``, ``consented`` turns and the number of feedback rows of each kind."""
        with self._lock:
            turns, consented = self._conn.execute("SELECT COUNT(*), COALESCE(SUM(consent), 0) FROM turns").fetchone()
            kinds = dict(self._conn.execute("SELECT kind, COUNT(*) FROM "
                                            "feedback GROUP BY kind").fetchall())
        return {"turns": turns, "consented": consented, **{kind: kinds.get(kind, 0) for kind in FEEDBACK_KINDS}}
