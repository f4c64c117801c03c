"""The export's origins (export/publishing/sources.py): each kind records the same dict and the
same inputs digest as the dict-based code before it, so exports made before are still reused."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from slm_align.errors import UserError
from slm_align.export.publishing.model_export import ModelExport
from slm_align.export.publishing.sources import (
    DirOrigin,
    GgufOrigin,
    HubOrigin,
    RunOrigin,
    check_stage,
    locate,
    origin_of,
)
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.runs import inputs_digest

BEFORE = {  # inputs_digest of ModelExport.inputs(), computed with main's dict-based sources.py
    "dir": "9423225a4ae24cf7f1f48dfe5b9f489349d6baa16d6ff72ff273d7ba65a26186",
    "gguf": "ed0c3466c0b1cc95c8035cd90663b2fb3cfc0242263ce99165194c3af3812a86",
    "hub": "49d5e3fba44ede7e0994a92f9aac45ed56f423faf7e4d3dd0f90fc623ad46ca0",
    "run": "714dceaad363e31eae2b42963f6c9ae728d1f4e354e9d0a8d595b8846876aa50",
    "run-sft": "a3786e6c0fdc25977698f41a70cc202bd2a671cb55dee301f7880a7322a23f1f",
    "run-rl": "022721088424b09414cb4ed3bda087b30306d9fc2e2ae3588057f60240bffc9a",
}
RECORDS = {
    "dir": {"kind": "dir", "path": "models/tiny"},
    "gguf": {"kind": "gguf", "ref": "models/tiny.gguf"},
    "hub": {"kind": "hub", "ref": "org/tiny"},
    "run": {"kind": "run", "run": "run"},
    "run-sft": {"kind": "run", "run": "run", "stage": "sft"},
    "run-rl": {"kind": "run", "run": "run", "stage": "rl"},
}


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """``./run`` with finished SFT and RL manifests (a relative path: the digest is portable)."""
    monkeypatch.chdir(tmp_path)
    model = {"kind": "bundled", "ref": None}
    for stage in ("sft", "rl"):
        manifest = {"stage": stage, "inputs": {"seed": 1, "model": model},
                    "inputs_hash": f"hash-{stage}", "files": {}}
        (tmp_path / "run" / stage / "adapter").mkdir(parents=True)
        (tmp_path / "run" / stage / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path / "run"


def export_digest(origin) -> str:
    request = SimpleNamespace(target="gguf", ort_format=False, calibrate=False)
    export = ModelExport(request, None, ("Q8_0", "p", 1), origin, Path("x"), 0.0)
    return inputs_digest(export.inputs())


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_kind_keeps_its_record_and_inputs_digest(fake_run, name):
    origin = origin_of(RECORDS[name])
    assert origin.record() == RECORDS[name]
    assert export_digest(origin) == BEFORE[name]


def test_a_stage_chosen_gives_the_same_origin_as_its_record(fake_run):
    staged = check_stage("rl", "run", RunOrigin("run"))
    assert staged == origin_of(RECORDS["run-rl"]) and export_digest(staged) == BEFORE["run-rl"]
    assert staged.exported_stage() == "rl" and RunOrigin("run").exported_stage() == "rl"
    assert staged.calibration_run() == Path("run")
    with pytest.raises(UserError, match="no finished dpo stage"):
        check_stage("dpo", "run", RunOrigin("run"))


NOT_RUNS = [DirOrigin("models/tiny"), GgufOrigin("a.gguf"), HubOrigin("o/m")]


@pytest.mark.parametrize("origin", NOT_RUNS)
def test_stage_and_calibration_are_for_runs_only(origin):
    with pytest.raises(UserError, match="is not a run directory .* drop --stage"):
        check_stage("rl", "SOURCE", origin)
    assert check_stage(None, "SOURCE", origin) is origin
    assert origin.calibration_run() is None and origin.exported_stage() is None
    assert origin.identity() is None


def test_locate_builds_one_origin_per_kind(fake_run, tmp_path):
    assert locate(str(fake_run), print) == RunOrigin(str(fake_run.resolve()))
    assert locate("org/tiny", print) == HubOrigin("org/tiny")
    (tmp_path / "tiny.gguf").write_bytes(b"")
    found = locate("tiny.gguf", print)
    assert found == GgufOrigin(str((tmp_path / "tiny.gguf").resolve())) and not found.gone()
    (tmp_path / "tiny.gguf").unlink()
    assert found.gone()
    seen = []
    bundled = locate(str(DEFAULT_MODEL_DIR), seen.append)
    assert bundled == DirOrigin(str(DEFAULT_MODEL_DIR.resolve())) and seen[0]["model_type"]
    assert bundled.local_path() == DEFAULT_MODEL_DIR.resolve()


def test_a_runs_architecture_is_its_sft_models(fake_run):
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    assert RunOrigin("run").model_type() == config["model_type"]  # the bundled model's record
    assert origin_of({"kind": "dir", "ref": str(DEFAULT_MODEL_DIR)}).model_type() \
        == config["model_type"]  # a stage's model record names its directory "ref"
