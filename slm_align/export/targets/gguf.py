"""``--target gguf``: one llama.cpp GGUF file, with an Ollama Modelfile and the folder's model card
beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from slm_align.export.publishing.model_card import CARD, card_blocked, gguf_card
from slm_align.export.publishing.modelfile import (
    build_modelfile,
    check_system_prompt,
    default_parameters,
    modelfile_path,
)
from slm_align.export.targets.base import ExportTarget
from slm_align.ondevice.gguf.architectures import check_gguf_config
from slm_align.ondevice.gguf.writer import (
    QUANTIZER_TYPES,
    check_gguf_type,
    quantize_gguf,
    write_gguf,
)


class GgufTarget(ExportTarget):
    name = "gguf"
    default_quant = "Q8_0"
    # the types benchmarks/quantization.py measures
    ladder = ("IQ4_XS", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "F32")
    gguf_run_target = "gguf-adapter"

    def device_quant(self, profile) -> Optional[str]:
        return profile.gguf_quant

    def check_quant(self, quant: str, preset: str) -> tuple[str, str]:
        return check_gguf_type(quant), preset

    def check_system(self, system: Optional[str]) -> None:
        check_system_prompt(system)

    def check_config(self, config: dict) -> None:
        check_gguf_config(config)

    def calibrates(self, quant: str) -> bool:
        return quant in QUANTIZER_TYPES

    def artifact_name(self, quant: str) -> str:
        return f"model-{quant}.gguf"

    def build(self, checkpoint: Path, scratch: Path, quant: str, settings: dict) -> Path:
        """F32 first, then llama.cpp's quantizer for its types (weighed by the importance matrix if
        any)."""
        built = scratch / self.artifact_name(quant)
        template = settings["template"]
        if quant not in QUANTIZER_TYPES:
            return write_gguf(checkpoint, built, quant, chat_template=template)
        full = write_gguf(checkpoint, scratch / "f32.gguf", "F32", chat_template=template)
        quantize_gguf(full, built, quant, settings["threads"], settings["importance"])
        full.unlink()
        return built

    def companions(self, export, built: Path, metrics: dict) -> dict[Path, str]:
        """The Ollama Modelfile and the folder's model card (unless the folder holds another's)."""
        final = export.final
        parameters = default_parameters(export.checkpoint)
        modelfile = build_modelfile(final.name, export.template_text(), parameters,
                                    export.request.system)
        metrics["modelfile"] = {"path": modelfile_path(final).name, "note": modelfile.note}
        companions = {modelfile_path(final): modelfile.text}
        blocked = card_blocked(final.parent)
        metrics["model_card"] = {"path": CARD, "note": blocked}
        if blocked is None:
            card = gguf_card(final.parent, export.source_path(), (final.name, metrics))
            companions[final.parent / CARD] = card
        return companions
