"""``--target gguf-adapter``: a run's LoRA adapters as llama.cpp adapter GGUFs bound by hash to
their base (:mod:`slm_align.export.publishing.adapter_export`, which runs the same publish
skeleton)."""

from __future__ import annotations

from slm_align.export.publishing.adapter_export import TARGET, run_adapter_export
from slm_align.export.publishing.request import ExportRequest
from slm_align.export.targets.base import ExportTarget
from slm_align.runs import StageResult


class GgufAdapterTarget(ExportTarget):
    name = TARGET
    default_quant = "F16"

    def run(self, request: ExportRequest, reuse: bool = False) -> StageResult:
        return run_adapter_export(request, reuse=reuse)
