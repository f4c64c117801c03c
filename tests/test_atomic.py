"""The one atomic writer: a target is either its old self or the whole new version,
and no temporary remains."""

from __future__ import annotations

import json
import os

import pytest

from slm_align.atomic import (
    atomic_path,
    atomic_paths,
    building_directory,
    publish_directory,
    scratch_directory,
    write_json_atomic,
    write_text_atomic,
)


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


def test_a_failed_build_leaves_the_earlier_folder_whole_and_no_scratch(tmp_path):
    out = tmp_path / "round2"
    out.mkdir()
    (out / "pairs.jsonl").write_text("old rows\n")
    with pytest.raises(RuntimeError):
        with building_directory(out, replace=True) as scratch:
            assert scratch.parent == tmp_path and scratch.name.startswith(".round2.")
            (scratch / "pairs.jsonl").write_text("half")
            raise RuntimeError("disk full")
    assert (out / "pairs.jsonl").read_text() == "old rows\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["round2"]


def test_a_finished_build_replaces_the_folder_and_leaves_no_scratch(tmp_path):
    out = tmp_path / "round2"
    out.mkdir()
    (out / "stale.jsonl").write_text("old")
    with building_directory(out, replace=True) as scratch:
        (scratch / "pairs.jsonl").write_text("new rows\n")
        assert not (out / "pairs.jsonl").exists()  # nothing shows before the block ends
    assert sorted(path.name for path in out.iterdir()) == ["pairs.jsonl"]
    assert (out / "pairs.jsonl").read_text() == "new rows\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["round2"]


def test_without_replace_an_existing_folder_is_kept_and_the_scratch_removed(tmp_path):
    out = tmp_path / "fleet"
    out.mkdir()
    (out / "device-1.db").write_text("old")
    with pytest.raises(OSError):
        with building_directory(out) as scratch:
            (scratch / "device-1.db").write_text("new")
    assert (out / "device-1.db").read_text() == "old"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fleet"]


def test_a_killed_writers_scratch_is_cleared_by_the_next_one(tmp_path):
    out = tmp_path / "fleet"
    dead = tmp_path / ".fleet.999999999.partial"  # no process has this id
    dead.mkdir()
    live = tmp_path / ".fleet.1.partial"  # pid 1 lives while the machine runs
    live.mkdir()
    with scratch_directory(out) as scratch:
        assert scratch.is_dir() and scratch.name == f".fleet.{os.getpid()}.partial"
        assert not dead.exists() and live.is_dir()
    assert not scratch.exists()
