"""The preference store's schema: the tables, the migrations from each version to the next, and the checks
a database made by another writer (a native app following docs/feedback-store.md) must pass."""

from __future__ import annotations

import sqlite3

from slm_align.errors import UserError

SCHEMA_VERSION = 5

_SCHEMA_V1 = """
CREATE TABLE turns (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT    NOT NULL,
    created_at      TEXT    NOT NULL,                -- ISO 8601, UTC
    model_id        TEXT    NOT NULL,                -- sha256 of the model artifact that answered
    messages        TEXT    NOT NULL,                -- JSON: the chat messages up to this turn (the prompt)
    completion      TEXT    NOT NULL,                -- the model's answer
    sampling        TEXT    NOT NULL,                -- JSON: the sampling parameters
    consent         INTEGER NOT NULL CHECK (consent IN (0, 1))
);
CREATE INDEX turns_by_conversation ON turns (conversation_id);
CREATE TABLE feedback (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id          INTEGER NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    kind             TEXT    NOT NULL CHECK (kind IN ('up', 'down', 'choice', 'edit')),
    other_completion TEXT,                            -- 'choice': the other candidate's text
    preferred        TEXT    CHECK (preferred IN ('this', 'other')),  -- 'choice': which one won
    edited_text      TEXT,                            -- 'edit': the user's corrected answer
    created_at       TEXT    NOT NULL,
    CHECK ((kind = 'choice') = (other_completion IS NOT NULL AND preferred IS NOT NULL)),
    CHECK ((kind = 'edit') = (edited_text IS NOT NULL))
);
CREATE INDEX feedback_by_turn ON feedback (turn_id);
"""

_V2_TURN_TOKENS = """
ALTER TABLE turns ADD COLUMN token TEXT;
"""
"""Each turn's random token, presented with feedback on it."""

_V3_AB_DECISIONS = """
CREATE TABLE ab_decisions (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at   TEXT    NOT NULL,
    current_id   TEXT    NOT NULL,                   -- model_id of the arm serving before the test
    candidate_id TEXT    NOT NULL,                   -- model_id of the candidate arm
    decision     TEXT    NOT NULL CHECK (decision IN ('promote', 'revert', 'keep')),
    evidence     TEXT    NOT NULL                    -- JSON: slm_align.ondevice.agent.ab_sequential.Evidence
);
CREATE INDEX turns_by_model ON turns (model_id);
"""
"""The decisions of A/B tests between two adapters (``serve --candidate``), appended; turns indexed by
``model_id`` (an arm's turns are read after every feedback)."""

_V4_AB_TRIALS = """
CREATE TABLE ab_trials (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at   TEXT    NOT NULL,
    current_id   TEXT    NOT NULL,                   -- model_id of the arm serving before the test
    candidate_id TEXT    NOT NULL,                   -- model_id of the candidate arm
    share        REAL    NOT NULL,                   -- the candidate's share of routed conversations
    key          TEXT    NOT NULL                    -- hex: signs the trial's conversation ids (secret)
);
CREATE TABLE ab_turns (
    turn_id      INTEGER PRIMARY KEY REFERENCES turns (id) ON DELETE CASCADE,
    trial_id     INTEGER NOT NULL REFERENCES ab_trials (id),
    arm          TEXT    NOT NULL CHECK (arm IN ('current', 'candidate')),
    client       TEXT    NOT NULL                    -- a pseudonym of who sent the turn
);
CREATE INDEX ab_turns_by_trial ON ab_turns (trial_id);
"""
"""A/B trials and the turns each routed (schema version 4): only those count in the test, one observation
per conversation; turns asked of an arm by name, or recorded before the trial, are not in ``ab_turns``."""

_V5_CALL_RESULTS = """
CREATE TABLE call_results (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id     INTEGER NOT NULL REFERENCES turns (id) ON DELETE CASCADE,
    call_index  INTEGER NOT NULL CHECK (call_index >= 0),  -- which call of the reply, 0 the first
    ok          INTEGER NOT NULL CHECK (ok IN (0, 1)),      -- 1: the app ran the call and it worked
    content     TEXT,                                       -- what the call returned (optional)
    created_at  TEXT    NOT NULL
);
CREATE INDEX call_results_by_turn ON call_results (turn_id);
"""
"""What an app reports of running a reply's calls itself (schema version 5): a function-calling app
runs the calls the model answered with, and whether each worked is the turn's outcome beside the
user's thumbs; appended, the latest report per call counts."""

AB_DECISIONS = ("promote", "revert", "keep")

# MIGRATIONS[v - 1] takes a database from version v - 1 to version v (statements split on ';').
MIGRATIONS: tuple[str, ...] = (_SCHEMA_V1, _V2_TURN_TOKENS, _V3_AB_DECISIONS, _V4_AB_TRIALS,
                                _V5_CALL_RESULTS)
assert len(MIGRATIONS) == SCHEMA_VERSION


def schema_version(conn: sqlite3.Connection) -> int:
    """The file's schema version; a newer one than this code knows is refused
    before anything is written."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise UserError(f"preference DB schema version {found} is newer than this slm-align "
                        f"supports ({SCHEMA_VERSION}); upgrade slm-align to open it")
    return found


_TURN_COLUMNS = ("id", "conversation_id", "created_at", "model_id", "messages", "completion", "sampling", "consent")
_FEEDBACK_COLUMNS = ("id", "turn_id", "kind", "other_completion", "preferred", "edited_text", "created_at")
_DECISION_COLUMNS = ("id", "created_at", "current_id", "candidate_id", "decision", "evidence")
_TRIAL_COLUMNS = ("id", "created_at", "current_id", "candidate_id", "share", "key")
_ROUTED_COLUMNS = ("turn_id", "trial_id", "arm", "client")
RESULT_COLUMNS = ("id", "turn_id", "call_index", "ok", "content", "created_at")
SPEC = "docs/feedback-store.md"
"""The written schema a writer outside slm-align (a native app) follows."""


def required_columns(version: int) -> dict[str, tuple[str, ...]]:
    """The columns each table has at schema ``version`` (1 or later)."""
    turns = _TURN_COLUMNS + ("token",) if version >= 2 else _TURN_COLUMNS
    tables = {"turns": turns, "feedback": _FEEDBACK_COLUMNS}
    if version >= 3:
        tables["ab_decisions"] = _DECISION_COLUMNS
    if version >= 4:
        tables["ab_trials"] = _TRIAL_COLUMNS
        tables["ab_turns"] = _ROUTED_COLUMNS
    if version >= 5:
        tables["call_results"] = RESULT_COLUMNS
    return tables


def _check_layout(conn: sqlite3.Connection, version: int) -> None:
    """Version 0 has no tables yet; a later version has every column this code reads (a
    foreign writer's slip)."""
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if version == 0:
        if tables & {"turns", "feedback", "ab_decisions", "ab_trials", "ab_turns", "call_results"}:
            raise UserError("preference DB has tables but schema version 0; its writer must set "
                            f"PRAGMA user_version = {SCHEMA_VERSION} after creating them (see {SPEC})")
        return
    for table, columns in required_columns(version).items():
        found = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        missing = [column for column in columns if column not in found]
        if missing:
            raise UserError(f"preference DB schema version {version}: table {table} lacks "
                            f"column(s) {', '.join(missing)}; create the tables as {SPEC} says")


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the schema up to :data:`SCHEMA_VERSION` in one transaction;
    return the version found."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = schema_version(conn)
        _check_layout(conn, found)
        for version in range(found + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version - 1].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return found
