"""``--target executorch``: an fp32 ``model.pte`` (XNNPACK delegate, static KV cache), verified
through ExecuTorch's Python runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from slm_align.export.converters.executorch import (
    check_executorch_architecture,
    check_executorch_quant,
    write_executorch,
)
from slm_align.export.targets.base import ExportTarget


class ExecutorchTarget(ExportTarget):
    name = "executorch"
    default_quant = "fp32"  # ExecuTorch programs are fp32 only
    ladder = ("fp32",)

    def check_quant(self, quant: str, preset: str) -> tuple[str, str]:
        return check_executorch_quant(quant), preset

    def check_architecture(self, model_type: Callable[[], Optional[str]]) -> None:
        check_executorch_architecture(model_type())

    def build(self, checkpoint: Path, scratch: Path, quant: str, settings: dict) -> Path:
        built = scratch / "artifact"
        write_executorch(checkpoint, built)
        if settings["template"] is not None:
            (built / "chat_template.jinja").write_text(settings["template"], encoding="utf-8")
        return built

    def open_backend(self, artifact: Path, threads: int, n_ctx: int):
        from slm_align.ondevice.agent.executorch_backend import ExecutorchBackend

        return ExecutorchBackend(artifact, threads=threads, n_ctx=n_ctx)
