"""The preference store's A/B records (schema version 4): the trials, the turns each routed, and the
observations the sequential test decides on (:mod:`slm_align.ondevice.agent.ab_sequential`).

A mixin of :class:`~slm_align.ondevice.agent.store.PreferenceStore`: it uses the store's one connection, lock and
write transaction.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any, Optional

from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_sequential import ARMS, Observation

KEY_BYTES = 32
"""The size of a trial's key (HMAC-SHA256)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class TrialRecords:
    """A/B trials in the store (mixed into ``PreferenceStore``)."""

    def open_trial(self, current_id: str, candidate_id: str, share: float) -> dict[str, Any]:
        """The trial between the two model ids: the latest recorded (a restart resumes it) or a new one
        with a new key; ``{id, created_at, current_id, candidate_id, share, key}``."""
        current_id, candidate_id = current_id.lower(), candidate_id.lower()
        with self._transaction() as conn:
            found = conn.execute("SELECT * FROM ab_trials WHERE current_id = ? AND candidate_id = ? "
                                 "ORDER BY id DESC LIMIT 1", (current_id, candidate_id)).fetchone()
            if found is None:
                conn.execute("INSERT INTO ab_trials (created_at, current_id, candidate_id, share, key) "
                             "VALUES (?, ?, ?, ?, ?)",
                             (_now(), current_id, candidate_id, float(share), secrets.token_hex(KEY_BYTES)))
                found = conn.execute("SELECT * FROM ab_trials WHERE id = last_insert_rowid()").fetchone()
        return dict(found)

    def trials(self, candidate_id: Optional[str] = None) -> list[dict[str, Any]]:
        """Every trial (or those of one candidate), oldest first, without their keys."""
        where, args = ("WHERE candidate_id = ?", (candidate_id.lower(),)) if candidate_id else ("", ())
        with self._lock:
            rows = self._conn.execute(f"SELECT id, created_at, current_id, candidate_id, share FROM ab_trials "
                                      f"{where} ORDER BY id", args).fetchall()
        return [dict(row) for row in rows]

    def record_routed(self, turn_id: int, trial_id: int, arm: str, client: str) -> None:
        """Name ``turn_id`` as routed to ``arm`` by the trial, sent by ``client`` (a pseudonym)."""
        if arm not in ARMS:
            raise UserError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
        with self._transaction() as conn:
            self._require_turn(conn, turn_id)
            conn.execute("INSERT INTO ab_turns (turn_id, trial_id, arm, client) VALUES (?, ?, ?, ?)",
                         (turn_id, trial_id, arm, str(client)))

    def routed_arm(self, turn_id: int) -> Optional[str]:
        """The arm a trial routed the turn to (None: not routed by any trial)."""
        with self._lock:
            found = self._conn.execute("SELECT arm FROM ab_turns WHERE turn_id = ?", (turn_id,)).fetchone()
        return found[0] if found else None

    def trial_observations(self, trial_id: int, source: str = "") -> list[Observation]:
        """Every thumbs verdict on the trial's routed turns, in the order given (``at``: the time, then
        the feedback id), with its conversation, arm and client; the test keeps each conversation's
        first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT a.arm, f.kind, t.conversation_id, f.created_at, f.id, a.client FROM ab_turns a "
                "JOIN turns t ON t.id = a.turn_id JOIN feedback f ON f.turn_id = a.turn_id "
                "WHERE a.trial_id = ? AND f.kind IN ('up', 'down') ORDER BY f.id", (trial_id,)).fetchall()
        return [Observation(arm, kind == "up", conversation, f"{at}#{feedback_id:019d}", client, source)
                for arm, kind, conversation, at, feedback_id, client in rows]
