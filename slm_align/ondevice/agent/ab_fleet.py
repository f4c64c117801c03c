"""A fleet's A/B decision (``slm-align feedback ab STORES...``): the trials of many devices' stores between
the same two adapters pooled into one sequential test
(:mod:`slm_align.ondevice.agent.ab_sequential`), each device a source: its conversations pair
among themselves and it counts at most ``max_per_device`` of them, so that no one
device (a heavy user, or a forged store) decides for the fleet.

A device may send its A/B evidence instead of its store: ``feedback ab prefs.db --observations FILE`` writes
each verdict on a routed turn as one JSON line (:data:`OBSERVATION_FIELDS`: the two model ids, the arm, up,
the conversation id, the time, the client's pseudonym; no text), and such a file is read like a store.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from slm_align.atomic import jsonl_text, write_text_atomic
from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_sequential import ARMS, Observation, SequentialTest, decide
from slm_align.ondevice.agent.store import SQLITE_HEADER, PreferenceStore

OBSERVATION_FIELDS = {"current_id": str, "candidate_id": str, "arm": str, "up": bool, "conversation": str,
                      "at": str, "client": str}
"""One line of an A/B observations file, and the type of each field."""
_MODEL_ID = re.compile(r"[0-9a-f]{64}")

MAX_PER_DEVICE = 20
"""Default cap on one device's conversations in a fleet decision: below the test's minimum of 40, so that one
device alone never decides."""


def _pair(trials: list[dict], candidate_id: Optional[str]) -> tuple[str, str]:
    """The (current, candidate) model ids the decision is about: the one pair the stores hold, or the pair
    of ``candidate_id``."""
    pairs = sorted({(trial["current_id"], trial["candidate_id"]) for trial in trials})
    if candidate_id:
        pairs = [pair for pair in pairs if pair[1] == candidate_id.lower()]
    if len(pairs) == 1:
        return pairs[0]
    if not pairs:
        raise UserError("the stores hold no A/B trial" + (f" of candidate {candidate_id}" if candidate_id else "")
                        + "; pass stores of devices that ran Agent.load(..., candidate=...) or serve --candidate")
    listed = ", ".join(f"{current[:12]} -> {candidate[:12]}" for current, candidate in pairs)
    raise UserError(f"the stores hold trials of {len(pairs)} pairs of adapters ({listed}); pass --candidate "
                    "MODEL_ID to pick one")


def fleet_test(max_per_device: int = MAX_PER_DEVICE, test: SequentialTest = SequentialTest()) -> SequentialTest:
    """The sequential test a fleet decides with: ``test`` with each device (source) capped."""
    if max_per_device < 1:
        raise UserError(f"--max-per-device {max_per_device}: must be 1 or more")
    return replace(test, max_per_source=max_per_device)


def fleet_decision(stores: Sequence[os.PathLike], candidate_id: Optional[str] = None,
                   max_per_device: int = MAX_PER_DEVICE, test: SequentialTest = SequentialTest()) -> dict:
    """The pooled decision over ``stores`` (each a device's preference store, read as is): ``{decision,
    current_id, candidate_id, devices, evidence}``. A file that is not a store is refused in one line."""
    capped = fleet_test(max_per_device, test)
    if len({Path(path).resolve() for path in stores}) != len(stores):
        raise UserError("a store is named twice; pass each device's store once (it would count twice)")
    found = [each for index, path in enumerate(stores) for each in read_source(Path(path), str(index))]
    current_id, candidate_id = _pair([trial for trial, _ in found], candidate_id)
    observations = [each for trial, seen in found if (trial["current_id"], trial["candidate_id"])
                    == (current_id, candidate_id) for each in seen]
    evidence = decide(observations, capped)
    devices = len({each.source for each in observations})
    return {"decision": evidence.decision, "current_id": current_id, "candidate_id": candidate_id,
            "devices": devices, "stores": len(stores), "max_per_device": max_per_device,
            "evidence": evidence.to_dict()}


def read_source(path: Path, source: str) -> list[tuple[dict, list[Observation]]]:
    """A device's trials, each ``({current_id, candidate_id}, its observations)``: from its store, or from the
    observations file it wrote; anything else is refused in one line."""
    if not path.is_file() or _header(path) in (SQLITE_HEADER, b""):
        with PreferenceStore(path, create=False) as store:
            return [(trial, store.trial_observations(trial["id"], source)) for trial in store.trials()]
    trials: dict = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        row = _observation_row(path, number, line)
        pair = (row["current_id"], row["candidate_id"])
        trials.setdefault(pair, []).append(Observation(row["arm"], row["up"], row["conversation"], row["at"],
                                                       row["client"], source))
    return [({"current_id": pair[0], "candidate_id": pair[1]}, seen) for pair, seen in trials.items()]


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(len(SQLITE_HEADER))


def _observation_row(path: Path, number: int, line: str) -> dict:
    """One line of an observations file, checked."""
    try:
        row = json.loads(line)
    except ValueError:
        row = None
    good = (isinstance(row, dict) and all(isinstance(row.get(key), kind) for key, kind in OBSERVATION_FIELDS.items())
            and row["arm"] in ARMS and all(_MODEL_ID.fullmatch(row[key]) for key in ("current_id", "candidate_id")))
    if not good:
        raise UserError(f"{path.name} line {number} is not an A/B observation; pass a device's preference store or "
                        "the file 'feedback ab STORE --observations FILE' wrote (a feedback export is neither)")
    return row


def write_observations(store_path: Path, out: Path) -> int:
    """Write every A/B observation of the store to ``out`` (new, owner-only, atomic); returns the rows."""
    if out.exists():
        raise UserError(f"{out} exists; pass a new path for --observations (nothing was written)")
    rows = [{"current_id": trial["current_id"], "candidate_id": trial["candidate_id"], "arm": each.arm, "up": each.up,
             "conversation": each.conversation, "at": each.at, "client": each.client}
            for trial, seen in read_source(store_path, "") for each in seen]
    write_text_atomic(out, jsonl_text(rows), mode=0o600)
    return len(rows)
