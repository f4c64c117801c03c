"""A fleet's A/B decision (``slm-align feedback ab STORES...``): the trials of many devices' stores between
the same two adapters pooled into one sequential test (:mod:`slm_align.ab_test`), each device a source:
its conversations pair among themselves and it counts at most ``max_per_device`` of them, so that no one
device (a heavy user, or a forged store) decides for the fleet."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from slm_align.ab_test import SequentialTest, decide
from slm_align.agent.store import PreferenceStore
from slm_align.errors import UserError

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


def fleet_decision(stores: Sequence[os.PathLike], candidate_id: Optional[str] = None,
                   max_per_device: int = MAX_PER_DEVICE, test: SequentialTest = SequentialTest()) -> dict:
    """The pooled decision over ``stores`` (each a device's preference store, read as is): ``{decision,
    current_id, candidate_id, devices, evidence}``. A file that is not a store is refused in one line."""
    if max_per_device < 1:
        raise UserError(f"--max-per-device {max_per_device}: must be 1 or more")
    if len({Path(path).resolve() for path in stores}) != len(stores):
        raise UserError("a store is named twice; pass each device's store once (it would count twice)")
    found = []
    for index, path in enumerate(stores):
        with PreferenceStore(path, create=False) as store:
            found.extend((index, trial, store.trial_observations(trial["id"], source=str(index)))
                         for trial in store.trials())
    current_id, candidate_id = _pair([trial for _, trial, _ in found], candidate_id)
    observations = [each for _, trial, seen in found if (trial["current_id"], trial["candidate_id"])
                    == (current_id, candidate_id) for each in seen]
    evidence = decide(observations, replace(test, max_per_source=max_per_device))
    devices = len({each.source for each in observations})
    return {"decision": evidence.decision, "current_id": current_id, "candidate_id": candidate_id,
            "devices": devices, "stores": len(stores), "max_per_device": max_per_device,
            "evidence": evidence.to_dict()}
