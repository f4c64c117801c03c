"""Which kind of artifact a path is (agent/backend.py)."""

from __future__ import annotations

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.backend import artifact_kind


def test_gguf_file_any_case(tmp_path):
    """A .gguf file is gguf, the suffix read case-blind (mutation: case-sensitive suffix)."""
    path = tmp_path / "model.GGUF"
    path.write_bytes(b"GGUF")
    assert artifact_kind(path) == "gguf"


@pytest.mark.parametrize("name", ["model.onnx", "model.ort"])
def test_onnx_export_directory(tmp_path, name):
    """A directory holding model.onnx or model.ort is onnx (mutation: .ort forgotten)."""
    (tmp_path / name).write_bytes(b"x")
    assert artifact_kind(str(tmp_path)) == "onnx"


@pytest.mark.parametrize("make", ["empty_dir", "gguf_dir", "other_file", "missing"])
def test_anything_else_is_a_one_line_refusal(tmp_path, make):
    """An empty directory, a directory named .gguf, another file or no file at all is refused with the fix
    (mutation: a directory named x.gguf taken as a model, or a missing path taken as onnx)."""
    path = {"empty_dir": tmp_path, "gguf_dir": tmp_path / "x.gguf", "other_file": tmp_path / "model.bin",
            "missing": tmp_path / "nothing.gguf"}[make]
    if make == "gguf_dir":
        path.mkdir()
    if make == "other_file":
        path.write_bytes(b"x")
    with pytest.raises(UserError) as caught:
        artifact_kind(path)
    message = str(caught.value)
    assert "\n" not in message
    assert "is not an exported model; pass a .gguf file or an ONNX export directory" in message
