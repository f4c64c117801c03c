"""``slm-align export``: a run, a merged directory or any model source -> a parity-checked GGUF,
ONNX, onnxruntime-genai or ExecuTorch artifact, or a run's adapters as GGUF adapters.

:func:`run_export` looks the target up in the registry (:mod:`slm_align.export.targets`) and runs
it; every target publishes through :func:`~slm_align.runs.publish_artifact` (scratch, verify, atomic
rename, reuse by inputs hash): :class:`~slm_align.export.publishing.model_export.ModelExport` for a
model, :mod:`~slm_align.export.publishing.adapter_export` for an adapter chain."""

from __future__ import annotations

from typing import Optional

from slm_align.export.publishing.request import ExportRequest, VerificationFailed
from slm_align.export.publishing.verification import next_higher_on
from slm_align.export.targets import target_named
from slm_align.runs import StageResult

__all__ = ["ExportRequest", "VerificationFailed", "artifact_name", "next_higher", "run_export"]


def artifact_name(target: str, quant: str) -> str:
    """The name ``target`` publishes at ``quant`` (``model-Q8_0.gguf``, ``onnx-w8``)."""
    return target_named(target).artifact_name(quant)


def next_higher(target: str, quant: str) -> Optional[str]:
    """The next type up ``target``'s precision ladder from ``quant`` (one not on it: the first above
    it in bits)."""
    return next_higher_on(target_named(target).ladder, quant)


def run_export(request: ExportRequest, reuse: bool = False) -> StageResult:
    """Export, verify and publish one artifact; returns its path and the manifest's metrics. With
    ``reuse``, an artifact already there made from the same inputs (its recorded inputs hash) is
    returned as it is."""
    return target_named(request.target).run(request, reuse=reuse)
