"""The one publish skeleton (:func:`slm_align.runs.publish_artifact`): scratch beside the destination,
verify, atomic rename, reuse by the recorded inputs hash alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slm_align.errors import UserError
from slm_align.runs import Artifact, artifact_manifest, publish_artifact, sha256_file


class Folder(Artifact):
    """A folder artifact made from one input file: its bytes decide the artifact (its path does not)."""

    def __init__(self, final: Path, source: Path, passes: bool = True):
        self.final, self.source, self.passes = final, source, passes
        self.builds = 0

    def inputs(self) -> dict:
        return {"source": sha256_file(self.source)}

    def build(self, scratch: Path) -> Path:
        self.builds += 1
        built = scratch / "artifact"
        built.mkdir()
        (built / "data.txt").write_text(self.source.read_text())
        return built

    def verify(self, built: Path) -> dict:
        if not self.passes:
            raise UserError("verification failed")
        return {"bytes": (built / "data.txt").stat().st_size}


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.endswith(".partial"))


@pytest.fixture
def published(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("old")
    final = tmp_path / "out" / "artifact"
    publish_artifact(Folder(final, source))
    return final, source


def test_a_published_folder_holds_its_manifest_and_inputs_hash(published):
    final, _ = published
    manifest = json.loads((final / "manifest.json").read_text())
    assert (final / "data.txt").read_text() == "old"
    assert manifest["metrics"] == {"bytes": 3} and list(manifest["files"]) == ["data.txt"]
    assert leftovers(final.parent) == []


def test_a_failing_verify_leaves_the_destination_untouched_and_no_scratch(published):
    final, source = published
    before = {path.name: path.read_bytes() for path in final.iterdir()}
    source.write_text("new")
    with pytest.raises(UserError, match="verification failed"):
        publish_artifact(Folder(final, source, passes=False), overwrite=True)
    assert {path.name: path.read_bytes() for path in final.iterdir()} == before
    assert leftovers(final.parent) == []


def test_an_existing_artifact_is_refused_in_one_line_unless_overwrite(published):
    final, source = published
    source.write_text("new")
    with pytest.raises(UserError, match=f"{final} exists; pass --overwrite") as refused:
        publish_artifact(Folder(final, source))
    assert "\n" not in str(refused.value) and (final / "data.txt").read_text() == "old"
    assert not publish_artifact(Folder(final, source), overwrite=True).skipped
    assert (final / "data.txt").read_text() == "new"


CRASH = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_publish_artifact import Folder
from slm_align.runs import publish_artifact

class Crashing(Folder):
    def verify(self, built):
        os._exit(9)  # killed between the scratch and the rename: no finally runs

publish_artifact(Crashing(Path({final!r}), Path({source!r})), overwrite=True)
"""


def test_a_crash_between_scratch_and_publish_leaves_the_old_artifact_whole(published):
    final, source = published
    source.write_text("new")
    script = CRASH.format(tests=str(Path(__file__).parent), final=str(final), source=str(source))
    paths = [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    assert subprocess.run([sys.executable, "-c", script], env=env).returncode == 9
    assert (final / "data.txt").read_text() == "old"
    assert json.loads((final / "manifest.json").read_text())["files"]["data.txt"] == sha256_file(final / "data.txt")
    assert len(leftovers(final.parent)) == 1  # the killed writer's scratch, hidden beside it
    assert not publish_artifact(Folder(final, source), overwrite=True).skipped  # the next writer is not blocked
    assert (final / "data.txt").read_text() == "new" and leftovers(final.parent) == []  # and clears it


def test_a_live_writers_scratch_is_left_alone(published):
    final, source = published
    live = final.with_name(f".{final.name}.1.partial")  # pid 1 never ends while the machine runs
    live.mkdir()
    dead = final.with_name(f".{final.name}.999999999.partial")
    dead.mkdir()
    source.write_text("new")
    publish_artifact(Folder(final, source), overwrite=True)
    assert leftovers(final.parent) == [live.name]


def test_reuse_happens_iff_the_recorded_inputs_hash_matches(published):
    final, source = published
    again = Folder(final, source)
    assert publish_artifact(again, reuse=True).skipped and again.builds == 0
    stamp = final.stat().st_mtime_ns
    os.utime(source, ns=(stamp + 10**9, stamp + 10**9))  # only a file time changes: still the same inputs
    os.utime(final / "data.txt", ns=(stamp - 10**12, stamp - 10**12))
    touched = Folder(final, source)
    assert publish_artifact(touched, reuse=True).skipped and touched.builds == 0
    (final / "data.txt").write_text("bad")  # damaged after publishing: made again, never reused
    damaged = Folder(final, source)
    assert not publish_artifact(damaged, overwrite=True, reuse=True).skipped and damaged.builds == 1
    source.write_text("changed")  # one input changes: made again
    changed = Folder(final, source)
    result = publish_artifact(changed, overwrite=True, reuse=True)
    assert not result.skipped and changed.builds == 1 and (final / "data.txt").read_text() == "changed"


def test_a_file_artifact_keeps_its_manifest_beside_it(tmp_path):
    class File(Artifact):
        final = tmp_path / "model.bin"

        def inputs(self):
            return {"n": 1}

        def build(self, scratch):
            (scratch / "model.bin").write_bytes(b"weights")
            return scratch / "model.bin"

    publish_artifact(File())
    assert (tmp_path / "model.bin").read_bytes() == b"weights"
    assert json.loads(artifact_manifest(tmp_path / "model.bin").read_text())["stage"] == "export"
    assert leftovers(tmp_path) == [] and publish_artifact(File(), reuse=True).skipped
