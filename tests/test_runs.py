"""Run directories (slm_align.runs): run_stage's skeleton (reuse by inputs, work dir, resume, publish), the
manifests and checksums that make a finished stage trustworthy, and the --out checks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import pytest

from slm_align.errors import UserError
from slm_align.runs import (
    MANIFEST,
    WHERE,
    aligned_stages,
    artifact_digest,
    check_out_file,
    digest,
    keep_first_lines,
    last_complete_checkpoint,
    read_manifest,
    run_stage,
    sha256_file,
    stage_identity,
)


class OneProcess:
    """A single-process world: rank 0 does everything."""

    main = True

    def on_main(self, work):
        return work()

    def barrier(self) -> None:
        pass


class Crash(Exception):
    """The stage's training was killed."""


class CountingStage:
    """A stage that writes ``weights.bin`` (its artifact) and ``scratch.tmp`` (dropped at publish), and records
    what run_stage asked of it."""

    keep = ("weights.bin",)

    def __init__(self, inputs: dict, crash: bool = False, name: str = "sft"):
        self.name = name
        self._inputs = inputs
        self.crash = crash
        self.world = OneProcess()
        self.calls: list[str] = []
        self.checkpoint: Optional[str] = None

    def inputs(self) -> dict:
        return self._inputs

    def setup(self) -> None:
        self.calls.append("setup")

    def train(self, partial: Path, checkpoint: Optional[str]) -> None:
        self.calls.append("train")
        self.checkpoint = checkpoint
        saved = partial / "checkpoints" / "checkpoint-2"
        saved.mkdir(parents=True, exist_ok=True)
        (saved / "trainer_state.json").write_text("{}")
        if self.crash:
            raise Crash

    def save(self, partial: Path) -> dict:
        self.calls.append("save")
        (partial / "weights.bin").write_bytes(b"\x01\x02")
        (partial / "scratch.tmp").write_text("scratch")
        return {"loss": 0.5}


def test_a_stage_runs_once_then_is_reused_with_the_same_inputs(tmp_path):
    first = CountingStage({"lr": 1e-4, WHERE: "/data/a.txt"})
    result = run_stage(first, tmp_path)
    stage_dir = tmp_path / "sft"
    assert (result.skipped, result.metrics, result.stage_dir) == (False, {"loss": 0.5}, stage_dir)
    assert first.calls == ["setup", "train", "save"]
    assert sorted(p.name for p in stage_dir.iterdir()) == [MANIFEST, "weights.bin"]  # scratch and checkpoints gone
    assert not (tmp_path / "sft.partial").exists()
    manifest = json.loads((stage_dir / MANIFEST).read_text())
    assert manifest["files"] == {"weights.bin": sha256_file(stage_dir / "weights.bin")}
    assert manifest["metrics"] == {"loss": 0.5} and manifest["inputs"]["lr"] == 1e-4

    again = CountingStage({"lr": 1e-4, WHERE: "/elsewhere/a.txt"})  # where the inputs lie is no identity
    reused = run_stage(again, tmp_path)
    assert (reused.skipped, reused.metrics, again.calls) == (True, {"loss": 0.5}, [])


def test_other_inputs_are_refused_and_the_finished_stage_is_kept(tmp_path):
    run_stage(CountingStage({"lr": 1e-4}), tmp_path)
    before = (tmp_path / "sft" / MANIFEST).read_bytes()
    other = CountingStage({"lr": 2e-4})
    with pytest.raises(UserError, match="made from other inputs"):
        run_stage(other, tmp_path)
    assert other.calls == [] and (tmp_path / "sft" / MANIFEST).read_bytes() == before


def test_an_interrupted_stage_needs_resume_and_continues_from_its_checkpoint(tmp_path):
    with pytest.raises(Crash):
        run_stage(CountingStage({"lr": 1e-4}, crash=True), tmp_path)
    partial = tmp_path / "sft.partial"
    assert partial.is_dir() and not (tmp_path / "sft").exists()
    with pytest.raises(UserError, match="pass --resume"):
        run_stage(CountingStage({"lr": 1e-4}), tmp_path)
    with pytest.raises(UserError, match="started with other inputs"):
        run_stage(CountingStage({"lr": 3e-4}), tmp_path, resume=True)
    resumed = CountingStage({"lr": 1e-4})
    result = run_stage(resumed, tmp_path, resume=True)
    assert resumed.checkpoint == str(partial / "checkpoints" / "checkpoint-2") and not result.skipped
    assert (tmp_path / "sft" / "weights.bin").read_bytes() == b"\x01\x02"


def test_the_newest_complete_checkpoint_wins_and_a_half_written_one_is_removed(tmp_path):
    for step, state in ((2, "{}"), (9, "{}"), (10, "{}"), (11, '{"half')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-12").mkdir()  # killed before trainer_state.json
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # 10 after 9: by number
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-2", "checkpoint-9"]
    assert last_complete_checkpoint(tmp_path / "none") is None


def test_a_changed_or_corrupt_stage_is_refused_in_one_line(tmp_path):
    run_stage(CountingStage({"lr": 1e-4}), tmp_path)
    stage_dir = tmp_path / "sft"
    (stage_dir / "weights.bin").write_bytes(b"\x09")
    with pytest.raises(UserError, match="does not match the checksum"):
        read_manifest(stage_dir)
    (stage_dir / "weights.bin").unlink()
    with pytest.raises(UserError, match="is missing"):
        read_manifest(stage_dir)
    (stage_dir / MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match="is corrupt"):
        read_manifest(stage_dir)
    assert read_manifest(tmp_path / "never") is None


def test_a_stage_is_named_by_its_content_wherever_the_run_lies(tmp_path):
    run_stage(CountingStage({"lr": 1e-4}), tmp_path / "run")
    shutil.copytree(tmp_path / "run", tmp_path / "moved")
    identity = stage_identity(tmp_path / "run" / "sft")
    assert identity is not None and stage_identity(tmp_path / "moved" / "sft") == identity
    assert stage_identity(tmp_path / "run" / "rl") is None
    run_stage(CountingStage({"lr": 2e-4}), tmp_path / "other")
    assert stage_identity(tmp_path / "other" / "sft") != identity


def test_an_artifacts_digest_covers_its_files_but_not_its_manifest_or_card(tmp_path):
    folder = tmp_path / "onnx"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"weights")
    (folder / "sub").mkdir()
    (folder / "sub" / "tokenizer.json").write_text("{}")
    first = artifact_digest(folder)
    (folder / MANIFEST).write_text("{}")
    (folder / "README.md").write_text("a card naming the digest")
    assert artifact_digest(folder) == first
    (folder / "sub" / "tokenizer.json").write_text('{"changed": 1}')
    assert artifact_digest(folder) != first
    single = tmp_path / "model.gguf"
    single.write_bytes(b"gguf bytes")
    assert artifact_digest(single) == sha256_file(single)
    assert digest({"b": 1, "a": 2}) == digest({"a": 2, "b": 1})  # key order is no identity


def test_aligned_stages_are_listed_oldest_first(tmp_path):
    for stage, when in (("kto", 100), ("rl", 200)):
        run_stage(CountingStage({"stage": stage}, name=stage), tmp_path)
        (tmp_path / stage / "adapter").mkdir()
        os.utime(tmp_path / stage / MANIFEST, ns=(when * 10**9, when * 10**9))
    assert aligned_stages(tmp_path) == ["kto", "rl"]
    os.utime(tmp_path / "kto" / MANIFEST, ns=(300 * 10**9, 300 * 10**9))
    assert aligned_stages(tmp_path) == ["rl", "kto"]


def test_out_files_are_checked_before_any_work(tmp_path):
    source = tmp_path / "export"
    source.mkdir()
    existing = tmp_path / "prefs.jsonl"
    existing.write_text("x")
    refusals = {source / "inside.jsonl": "is an input", source: "is an input", tmp_path: "is a directory",
                tmp_path / "nowhere" / "a.jsonl": "does not exist", existing: "exists; pass --overwrite"}
    for out, reason in refusals.items():
        with pytest.raises(UserError, match=reason):
            check_out_file(out, inputs=[source])
    assert check_out_file(existing, overwrite=True) == existing
    assert existing.read_text() == "x"  # checked, never touched


def test_a_log_is_cut_back_to_its_first_complete_lines(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "half')
    keep_first_lines(log, 2)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    keep_first_lines(log, 5)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    keep_first_lines(tmp_path / "absent.jsonl", 1)
    assert not (tmp_path / "absent.jsonl").exists()
