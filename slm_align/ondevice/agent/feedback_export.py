"""Export consented on-device feedback as preference data for the next round
(TRL's conversational format).

Two JSONL files, because the two kinds of rows feed different trainers and the repo's importer
(:func:`slm_align.data.preferences.read_preferences`) reads unpaired rows as text only:

- ``OUT`` (e.g. ``prefs.jsonl``): paired rows ``{"prompt": [messages], "chosen": [{"role":
  "assistant", ...}], "rejected": [{"role": "assistant", ...}]}`` from 'choice' feedback (the winner
  is chosen) and 'edit' feedback (the user's edit is chosen over the model's answer). The importer
  reads this file directly; so does TRL's DPO/reward trainers.
- every row also carries ``model_id``: the sha256 of the artifact the feedback was given to, so that
  ``train --algo dpo|kto`` can refuse feedback about a model the run did not export; and ``tools``
  (TRL's column) when the turn's prompt offered tools, so that training renders the prompt as answered.
- ``OUT`` with ``.unpaired.jsonl`` for ``.jsonl`` (e.g. ``prefs.unpaired.jsonl``): unpaired rows
  ``{"prompt": [messages], "completion": [{"role": "assistant", ...}], "label": true|false}`` from
  thumbs up/down (TRL's KTO format).

Both files are always written (one may be empty, so no stale file from an earlier export is left
beside them), atomically and owner-only (0o600). Only turns with consent are exported. Feedback rows
are append-only, so the latest verdict per question counts: the last thumbs on a turn, its last
edit, and the last verdict against each distinct other candidate.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slm_align.atomic import atomic_paths, jsonl_text
from slm_align.errors import UserError
from slm_align.ondevice.agent.scrub import detectors
from slm_align.ondevice.agent.scrub import scrub as scrub_text
from slm_align.ondevice.agent.store import Feedback, PreferenceStore, Turn
from slm_align.runs import check_out_dir

UNPAIRED_SUFFIX = ".unpaired.jsonl"


def unpaired_path(out_path: str | os.PathLike) -> Path:
    """Where the unpaired (thumbs) rows go beside ``out_path``: ``prefs.jsonl`` ->
    ``prefs.unpaired.jsonl``."""
    out = Path(out_path)
    return out.with_name(out.name[: -len(".jsonl")] + UNPAIRED_SUFFIX)


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _question(feedback: Feedback) -> str:
    """What a verdict answers; a later verdict on the same question replaces an earlier one. A turn gives
    at most one verdict (up or down) and one pair (its latest choice or edit): a client that compares one
    turn with hundreds of alternatives does not multiply its weight in the training data."""
    return "verdict" if feedback.kind in ("up", "down") else "pair"


def latest_verdicts(turn: Turn) -> list[Feedback]:
    """The turn's feedback with only the latest verdict per question, oldest first."""
    latest = {_question(f): f for f in sorted(turn.feedback, key=lambda f: f.id)}
    return sorted(latest.values(), key=lambda f: f.id)


def _tools(turn: Turn) -> dict[str, Any]:
    """``{"tools": [...]}`` when the turn's prompt offered tools (its sampling record names them), else
    nothing: TRL's ``tools`` column, so that training renders the prompt the model answered."""
    tools = turn.sampling.get("tools") if isinstance(turn.sampling, dict) else None
    return {"tools": tools} if isinstance(tools, list) and tools else {}


def verdict_row(turn: Turn, feedback: Feedback) -> dict[str, Any] | None:
    """One TRL row for a verdict; None when chosen and rejected would be the same text."""
    if feedback.kind in ("up", "down"):
        return {"prompt": turn.messages, "completion": _assistant(turn.completion), "label": feedback.kind == "up",
                "model_id": turn.model_id, **_tools(turn)}
    if feedback.kind == "choice":
        pair = (turn.completion, feedback.other_completion)
        chosen, rejected = pair if feedback.preferred == "this" else pair[::-1]
    else:
        chosen = feedback.edited_text
        rejected = turn.completion
    if chosen.strip() == rejected.strip():
        return None
    return {"prompt": turn.messages, "chosen": _assistant(chosen), "rejected": _assistant(rejected),
            "model_id": turn.model_id, **_tools(turn)}


def _scrub_value(value: Any, key: str = "") -> tuple[Any, int]:
    """``value`` with every string in it scrubbed, however deeply nested (tool-call arguments included), the
    keys of objects too: a model may put an address where a key goes. ``key``, the object key the value sits
    under, is read as context: ``{"password": "hunter2"}`` and ``{"ssn": "123456789"}`` are scrubbed."""
    if isinstance(value, str):
        return scrub_text(value, context=key)
    if isinstance(value, dict):
        return _scrub_object(value)
    if isinstance(value, list):
        items = [_scrub_value(item, key) for item in value]
        return [item for item, _ in items], sum(count for _, count in items)
    return value, 0


def _scrub_object(value: dict) -> tuple[dict, int]:
    """An object with its keys and values scrubbed; two keys scrubbed alike (two addresses) stay two entries,
    the later one numbered."""
    scrubbed: dict = {}
    total = 0
    for key, item in value.items():
        new_key, key_count = scrub_text(key) if isinstance(key, str) else (key, 0)
        new_item, item_count = _scrub_value(item, key if isinstance(key, str) else "")
        unique = new_key
        number = 2
        while unique in scrubbed:
            unique = f"{new_key} {number}"
            number += 1
        scrubbed[unique] = new_item
        total += key_count + item_count
    return scrubbed, total


def scrub_row(row: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The row with personal data replaced in every string of its message columns (contents, tool
    calls and their arguments, names), and the number of replacements; the label and other
    metadata stay as they are."""
    out = {}
    total = 0
    for column, value in row.items():
        if isinstance(value, list):
            value, count = _scrub_value(value)
            total += count
        out[column] = value
    return out, total


def _check_paths(store_path: Path, out: Path, overwrite: bool) -> None:
    if out.suffix.lower() != ".jsonl":
        raise UserError(f"feedback export writes JSONL; name the output with .jsonl (got {out})")
    if store_path.resolve() in (out.resolve(), unpaired_path(out).resolve()):
        raise UserError(f"output {out} (or its .unpaired.jsonl sibling) is the preference DB itself; pass another "
                        "--out")
    check_out_dir(out.parent)
    for path in (out, unpaired_path(out)):
        if path.is_dir():
            raise UserError(f"output {path} is a directory; pass a file path ending in .jsonl")
        if path.exists() and not overwrite:
            raise UserError(f"output {path} exists; pass --overwrite to replace it "
                            "or choose another --out")


def _write_jsonl_pair(files: list[tuple[Path, list[dict[str, Any]]]]) -> None:
    """Both files written in full first, then both renamed (owner-only): a
    failure publishes neither."""
    targets = [path for path, _ in files]
    with atomic_paths(*targets, mode=0o600) as temps:
        for tmp, (_, rows) in zip(temps, files):
            tmp.write_text(jsonl_text(rows), encoding="utf-8")


def collect_rows(turns: Iterable[Turn], scrub: bool = True) -> tuple[list[dict], list[dict], dict[str, int]]:
    """``(paired rows, unpaired rows, counts)`` from the consented turns' latest verdicts."""
    paired = []
    unpaired = []
    counts = {"skipped_without_consent": 0, "skipped_identical": 0, "scrubbed_replacements": 0}
    for turn in turns:
        for feedback in latest_verdicts(turn):
            if not turn.consent:
                counts["skipped_without_consent"] += 1
                continue
            row = verdict_row(turn, feedback)
            if row is None:
                counts["skipped_identical"] += 1
                continue
            if scrub:
                row, replaced = scrub_row(row)
                counts["scrubbed_replacements"] += replaced
            (paired if "chosen" in row else unpaired).append(row)
    return paired, unpaired, counts


def export_preferences(store_path: str | os.PathLike, out_path: str | os.PathLike, scrub: bool = True,
                       overwrite: bool = False) -> dict[str, Any]:
    """Write the consented feedback in ``store_path`` to ``out_path`` (pairs) and its
    ``.unpaired.jsonl`` sibling.

    Returns ``pairs``, ``unpaired``, ``skipped_without_consent``, ``skipped_identical``,
    ``scrubbed_replacements``, ``scrubbed_by`` (the detectors that ran: ``["regex floor"]``, plus
    ``"detect-secrets X.Y"`` where installed; ``[]`` without scrubbing) and the two paths written (``out``,
    ``unpaired_out``). Bad input is a UserError and writes nothing.
    """
    store_path = Path(store_path)
    out = Path(out_path)
    _check_paths(store_path, out, overwrite)
    with PreferenceStore(store_path, create=False) as store:
        turns = store.turns()
    paired, unpaired, counts = collect_rows(turns, scrub=scrub)
    if not paired and not unpaired:
        if counts["skipped_identical"]:
            raise UserError(f"no usable feedback in DB {store_path}: every consented choice or edit equals the "
                            "original answer; collect more feedback")
        raise UserError(f"no consented feedback in DB {store_path}; record thumbs/choices/edits on turns whose "
                        "user gave consent (set_consent) and export again")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_jsonl_pair([(out, paired), (unpaired_path(out), unpaired)])
    except OSError as exc:  # a read-only or virtual folder (/proc), no permission, a full disk
        raise UserError(f"cannot write {out} ({exc.strerror or exc}); pass --out in a folder you can write") from None
    return {"pairs": len(paired), "unpaired": len(unpaired), **counts, "scrubbed_by": detectors() if scrub else [],
            "out": str(out), "unpaired_out": str(unpaired_path(out))}
