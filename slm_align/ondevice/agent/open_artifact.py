"""Open an exported artifact with the backend that runs it: llama.cpp for a GGUF file, onnxruntime
for an ONNX folder (each imports its runtime only when it opens a model)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from slm_align.ondevice.agent.backend import Backend, artifact_kind
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.ondevice.agent.onnx_backend import OnnxBackend


def open_backend(artifact: Path, threads: Optional[int] = None, n_ctx: Optional[int] = None,
                 all_logits: bool = False, adapters: Sequence[Path] = ()) -> Backend:
    """The backend for ``artifact``: llama.cpp for GGUF (with its LoRA ``adapters``), onnxruntime for ONNX."""
    if artifact_kind(artifact) == "gguf":
        return LlamaCppBackend(artifact, threads=threads, n_ctx=n_ctx, all_logits=all_logits, adapters=adapters)
    return OnnxBackend(artifact, threads=threads, n_ctx=n_ctx)
