"""The one atomic writer: a target is either its old self or the whole new version,
and no temporary remains."""

from __future__ import annotations

import json
import os

import pytest

from slm_align.atomic import atomic_path, atomic_paths, publish_directory, write_json_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_a_tool_writes_the_temporary_and_the_target_appears_whole(tmp_path):
    target = tmp_path / "deep" / "model.gguf"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".model.gguf.")
        assert not target.exists()
        tmp.write_bytes(b"GGUF")
    assert target.read_bytes() == b"GGUF"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]


def test_several_files_are_published_together_or_not_at_all(tmp_path):
    first = tmp_path / "pairs.jsonl"
    second = tmp_path / "unpaired.jsonl"
    second.write_text("kept")
    with pytest.raises(OSError):
        with atomic_paths(first, second) as temps:
            temps[0].write_text("a")
            raise OSError("no space left")
    assert not first.exists() and second.read_text() == "kept"
    with atomic_paths(first, second, mode=0o600) as temps:
        temps[0].write_text("a")
        temps[1].write_text("b")
    assert first.read_text() == "a" and second.read_text() == "b"
    assert os.stat(first).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl", "unpaired.jsonl"]


def test_text_and_json_round_trip(tmp_path):
    write_text_atomic(tmp_path / "a.txt", "héllo")
    write_json_atomic(tmp_path / "b.json", {"z": 1, "a": [1, 2]})
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo"
    assert json.loads((tmp_path / "b.json").read_text()) == {"a": [1, 2], "z": 1}


def test_a_directory_is_renamed_into_place_and_replace_is_explicit(tmp_path):
    built = tmp_path / "built"
    built.mkdir()
    (built / "model.onnx").write_bytes(b"new")
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.onnx").write_bytes(b"old")
    with pytest.raises(OSError):
        publish_directory(built, final)
    assert (final / "model.onnx").read_bytes() == b"old"
    publish_directory(built, final, replace=True)
    assert (final / "model.onnx").read_bytes() == b"new" and not built.exists()


def test_a_failed_flush_publishes_nothing(tmp_path, monkeypatch):
    import errno

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "pairs.jsonl"
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_text_atomic(target, "row\n")
    assert list(tmp_path.iterdir()) == []
