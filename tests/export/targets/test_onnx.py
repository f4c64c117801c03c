"""``--target onnx`` (export/targets/onnx.py): quant checks, the preset passed on, the chat template
written beside the converted model."""

from __future__ import annotations

import pytest

from slm_align.errors import UserError
from slm_align.export.targets import onnx as onnx_target
from slm_align.export.targets.onnx import OnnxTarget


def test_defaults_are_on_the_ladder():
    """w8 is the default and on the ladder (mutation: a default the ladder cannot step from)."""
    target = OnnxTarget()
    assert target.default_quant == "w8" and target.default_quant in target.ladder


def test_check_quant_and_preset():
    """Normalised quant, validated preset, the preset handed to the converter (mutation: preset dropped)."""
    target = OnnxTarget()
    assert target.check_quant("INT4", "avx512") == ("int4", "avx512")
    assert target.onnx_preset("avx512") == "avx512"
    with pytest.raises(UserError, match="unknown ONNX quantization 'Q8_0'"):
        target.check_quant("Q8_0", "avx2")


@pytest.mark.parametrize("template", [None, "{{ messages }}"])
def test_build_writes_the_template_only_when_given(tmp_path, monkeypatch, template):
    """The converter gets quant, preset and ORT flag; a template is written as chat_template.jinja
    (mutation: the template lost, or an empty file written for None)."""
    seen = {}

    def fake_write_onnx(checkpoint, out, quant, preset, ort_format):
        seen.update(checkpoint=checkpoint, quant=quant, preset=preset, ort_format=ort_format)
        out.mkdir()
        (out / "model.onnx").write_bytes(b"")

    monkeypatch.setattr(onnx_target, "write_onnx", fake_write_onnx)
    built = OnnxTarget().build(tmp_path / "ckpt", tmp_path, "w8",
                               {"preset": "arm64", "ort_format": True, "template": template})
    assert built == tmp_path / "artifact"
    assert seen == {"checkpoint": tmp_path / "ckpt", "quant": "w8", "preset": "arm64", "ort_format": True}
    written = built / "chat_template.jinja"
    assert written.exists() is (template is not None)
    if template is not None:
        assert written.read_text(encoding="utf-8") == template
