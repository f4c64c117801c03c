"""The export target registry: one class per ``--target``, each registered once, and a target added in one
place runs through the publish skeleton without any change to the export stage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from slm_align.errors import UserError
from slm_align.export.publishing.stage import ExportRequest, artifact_name, run_export
from slm_align.export.targets import REGISTRY, ExportTarget, register, target_named
from slm_align.modeling.models import DEFAULT_MODEL_DIR

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"


def test_each_target_is_one_class_registered_once():
    assert list(REGISTRY) == ["gguf", "gguf-adapter", "onnx", "genai", "executorch"]
    classes = [type(target) for target in REGISTRY.values()]
    assert len(set(classes)) == len(classes) and all(issubclass(cls, ExportTarget) for cls in classes)
    assert all(target.name == name for name, target in REGISTRY.items())
    with pytest.raises(ValueError, match="registered twice"):
        register(type(REGISTRY["onnx"])())
    assert list(REGISTRY) == ["gguf", "gguf-adapter", "onnx", "genai", "executorch"]


def test_an_unknown_target_is_one_line_naming_every_registered_one():
    with pytest.raises(UserError) as refused:
        target_named("tflite")
    assert str(refused.value) == "--target tflite: choose gguf, gguf-adapter, onnx, genai or executorch"


def test_no_target_branches_outside_the_registry():
    """A format's differences live in its target class: no ``target ==`` / ``target !=`` elsewhere."""
    branch = re.compile(r"\btarget\s*[!=]=")
    found = [f"{path.relative_to(PACKAGE)}:{number}"
             for path in PACKAGE.rglob("*.py") if "targets" not in path.relative_to(PACKAGE).parts
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if branch.search(line)]
    assert found == []


class RawTarget(ExportTarget):
    """A made-up format: the checkpoint's config and tokenizer copied into a folder."""

    name = "raw"
    default_quant = "copy"
    ladder = ("copy",)

    def check_quant(self, quant, preset):
        if quant != "copy":
            raise UserError(f"--quant {quant}: raw exports copy only")
        return quant, preset

    def build(self, checkpoint, scratch, quant, settings):
        built = scratch / "artifact"
        built.mkdir()
        for name in ("config.json", "tokenizer.json"):
            (built / name).write_bytes((Path(checkpoint) / name).read_bytes())
        return built


def test_a_new_target_registered_in_one_place_is_run_by_the_skeleton(tmp_path, monkeypatch):
    monkeypatch.setitem(REGISTRY, "raw", RawTarget())
    result = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "raw", out=tmp_path, verify=False))
    final = tmp_path / "raw-copy"
    assert result.stage_dir == final == tmp_path / artifact_name("raw", "copy") and not result.skipped
    manifest = json.loads((final / "manifest.json").read_text())
    assert (manifest["metrics"]["target"], manifest["metrics"]["quant"]) == ("raw", "copy")
    assert manifest["inputs"]["target"] == "raw" and set(manifest["files"]) == {"config.json", "tokenizer.json",
                                                                                "README.md"}
    assert (final / "config.json").read_bytes() == (DEFAULT_MODEL_DIR / "config.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw-copy"]  # no scratch left
    with pytest.raises(UserError, match="raw-copy exists; pass --overwrite"):
        run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "raw", out=tmp_path, verify=False))
    assert run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "raw", out=tmp_path, verify=False), reuse=True).skipped
    with pytest.raises(UserError, match="raw exports copy only"):
        run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "raw", quant="Q8_0", out=tmp_path / "b", verify=False))
    assert not (tmp_path / "b").exists()
