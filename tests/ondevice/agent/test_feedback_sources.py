"""Where feedback collect reads a fleet's rows from (agent/feedback_sources.py): stores read-only,
export files line by line, device and arm names, the dedupe key."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

import pytest

from slm_align.ondevice.agent.feedback_sources import (
    NotFeedback,
    arm_of,
    device_of,
    read_input,
    turn_key,
)
from slm_align.ondevice.agent.store import PreferenceStore

MODEL = "a" * 64
ADAPTERS = {"adapters": [{"file": "sft.gguf"}, {"file": "dpo.gguf"}]}


def prompt(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("name, device", [("phone-17.db", "phone-17"), ("phone-17.unpaired.jsonl", "phone-17"),
                                          ("board", "board")])
def test_device_is_the_name_up_to_the_first_dot(tmp_path, name, device):
    """Mutation: stem (last suffix only) used instead."""
    assert device_of(tmp_path / name) == device


@pytest.mark.parametrize("sampling, arm", [(ADAPTERS, "sft.gguf+dpo.gguf"), ({"adapters": []}, "base"),
                                           ({}, "base"), (None, "base"), ({"adapters": ["x"]}, "base")])
def test_arm_names_the_adapters(sampling, arm):
    """Adapters joined with '+', 'base' for none or malformed (mutation: crash on a non-dict)."""
    assert arm_of(sampling) == arm


def test_turn_key_separates_kinds_models_and_tools():
    """Same content under another model, kind or tools is another key; the same row the same key
    (mutation: a field left out of the key)."""
    verdict = {"model_id": MODEL, "prompt": prompt("q"), "completion": answer("a"), "label": True}
    assert turn_key(verdict) == turn_key(dict(verdict))
    assert turn_key(verdict) == turn_key({**verdict, "label": False})  # the latest verdict wins later
    assert turn_key(verdict) != turn_key({**verdict, "model_id": "b" * 64})
    assert turn_key(verdict) != turn_key({**verdict, "tools": [{"name": "t"}]})
    pair = {"model_id": MODEL, "prompt": prompt("q"), "chosen": answer("a"), "rejected": answer("b")}
    assert turn_key(pair) != turn_key({**pair, "rejected": answer("c")})


def test_store_rows_consented_only_with_device_arm_and_counts(tmp_path):
    """Turns without consent are counted, not yielded; identical pairs counted; rows carry device and arm
    (mutation: consent ignored, counts lost)."""
    path = tmp_path / "phone-1.db"
    with PreferenceStore(path) as store:
        up = store.record_turn("c1", prompt("hi"), "Hello.", MODEL, ADAPTERS, True)
        store.thumbs(up, True)
        same = store.record_turn("c2", prompt("x"), "Same.", MODEL, {}, True)
        store.choose(same, "Same.", "other")
        private = store.record_turn("c3", prompt("secret"), "No.", MODEL, {}, False)
        store.thumbs(private, False)
    counts = Counter()
    rows = list(read_input(path, counts))
    assert len(rows) == 1
    assert rows[0].device == "phone-1" and rows[0].arm == "sft.gguf+dpo.gguf"
    assert rows[0].row["label"] is True and rows[0].key == turn_key(rows[0].row)
    assert counts == {"without_consent": 1, "identical": 1}


def test_store_is_opened_read_only(tmp_path):
    """Reading never writes the file (mutation: a read-write connection that migrates or journals)."""
    path = tmp_path / "phone-1.db"
    with PreferenceStore(path) as store:
        store.thumbs(store.record_turn("c1", prompt("hi"), "Hello.", MODEL, {}, True), True)
    before = path.read_bytes()
    list(read_input(path, Counter()))
    assert path.read_bytes() == before


def test_export_rows_keep_good_lines_and_count_the_rest(tmp_path):
    """Pairs and verdicts with a sha256 model_id are rows, tools kept; other lines counted
    (mutation: a bad line stops the file, or extra keys kept)."""
    good = {"model_id": MODEL, "prompt": prompt("q"), "completion": answer("a"), "label": False, "extra": 1}
    pair = {"model_id": MODEL, "prompt": prompt("q"), "chosen": answer("a"), "rejected": answer("b"),
            "tools": [{"type": "function"}]}
    lines = [json.dumps(good), "", "not json", json.dumps({**good, "model_id": "short"}), json.dumps(pair)]
    path = tmp_path / "phone-2.jsonl"
    path.write_text("\n".join(lines) + "\n")
    counts = Counter()
    rows = list(read_input(path, counts))
    assert [row.row for row in rows] == [{key: good[key] for key in ("prompt", "completion", "label", "model_id")},
                                         pair]
    assert all(row.device == "phone-2" and row.arm is None for row in rows)
    assert counts == {"not_feedback_rows": 2}


def test_export_file_of_no_rows_is_refused(tmp_path):
    """Mutation: a file of nothing but junk passes as an empty export."""
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\nnope\n')
    with pytest.raises(NotFeedback, match="none of its 2 lines is a feedback row"):
        list(read_input(path, Counter()))


@pytest.mark.parametrize("make, words", [
    ("missing", "not found"), ("text", "no SQLite header"), ("other_sqlite", "without the store's turns"),
    ("binary_jsonl", "not text"),
])
def test_what_is_not_ours_is_refused_in_one_line(tmp_path, make, words):
    """A missing path, a text file, another SQLite database, a binary .jsonl (mutation: a raw
    sqlite3 or Unicode error escapes)."""
    path = tmp_path / ("in.jsonl" if make == "binary_jsonl" else "in.db")
    if make == "text":
        path.write_text("hello\n")
    if make == "other_sqlite":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE notes (x)")
        conn.close()
    if make == "binary_jsonl":
        path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(NotFeedback, match=words) as caught:
        list(read_input(path, Counter()))
    assert "\n" not in str(caught.value)
