"""``--target onnx``: an onnxruntime folder (``model.onnx``, tokenizer, model card, manifest)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from slm_align.export.converters.onnx import check_onnx_quant, write_onnx
from slm_align.export.targets.base import ExportTarget


class OnnxTarget(ExportTarget):
    name = "onnx"
    default_quant = "w8"  # the scheme that passes on real weights
    ladder = ("int4", "w8", "fp32")  # int8 (dynamic) probes w8

    def check_quant(self, quant: str, preset: str) -> tuple[str, str]:
        return check_onnx_quant(quant, preset)

    def onnx_preset(self, preset: str) -> Optional[str]:
        return preset

    def build(self, checkpoint: Path, scratch: Path, quant: str, settings: dict) -> Path:
        built = scratch / "artifact"
        write_onnx(checkpoint, built, quant, settings["preset"], settings["ort_format"])
        if settings["template"] is not None:
            (built / "chat_template.jinja").write_text(settings["template"], encoding="utf-8")
        return built
