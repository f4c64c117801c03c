"""What ``slm-align export`` is asked to do (:class:`ExportRequest`, one field per flag), and the
error a failed verification raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from slm_align.errors import UserError


class VerificationFailed(UserError):
    """The artifact does not behave like the PyTorch model; nothing was published."""

    exit_code = 1


@dataclass
class ExportRequest:
    """What to export and how; one field per ``slm-align export`` flag."""

    source: str
    """Run directory, merged/HF model directory, .gguf file or hub id."""
    target: str = "gguf"
    """gguf (llama.cpp), onnx (onnxruntime), genai (an onnxruntime-genai folder: the ONNX
    export + its config) or executorch (an fp32 ``model.pte`` with the XNNPACK delegate
    and a static KV cache)."""
    quant: Optional[str] = None
    """GGUF type (F32, F16, Q8_0, Q4_K_M, ...) or ONNX fp32/w8/int8/int4; default: GGUF the
    device's, else Q8_0; ONNX and genai w8 (the scheme that passes on real weights; a device changes
    only the int8 preset)."""
    device: Optional[str] = None
    """Device profile name: picks the quantization, the int8 preset and the thread count."""
    out: Optional[Path] = None
    """Output directory (default RUN/export for a run, ./export otherwise)."""
    verify: bool = True
    """Check parity with the PyTorch model before publishing (recorded when off)."""
    overwrite: bool = False
    """Replace an existing artifact of the same name."""
    force: bool = False
    """Publish even when verification fails (recorded)."""
    calibrate: bool = False
    """GGUF types from llama.cpp's quantizer: an importance matrix from the run's held-out texts
    (never its training or evaluation items) weighs the rounding."""
    min_agreement: float = 0.9
    """Lowest top-1 agreement with PyTorch that a low-bit artifact may have."""
    ort_format: bool = False
    """ONNX: also convert the graph to the ORT format of onnxruntime's mobile builds."""
    threads: Optional[int] = None
    """Threads for quantization and verification (default: the device's, else all cores)."""
    preset: Optional[str] = field(default=None)
    """ONNX int8 preset (arm64, avx2, avx512, avx512_vnni); default from the
    device, else this host's."""
    system: Optional[str] = None
    """GGUF: the system prompt of the Ollama Modelfile written beside the artifact."""
    torch_device: str = "auto"
    """Where the PyTorch side of the parity check runs (auto, cpu, cuda, cuda:N, mps)."""
    chat_template: Optional[str] = None
    """"chatml" or a Jinja file: written into the artifact in place of the model's own
    (recorded in the manifest)."""
    stage: Optional[str] = None
    """A run's policy to export: ``sft`` (the prior), ``rl``, ``dpo`` or ``kto`` (that stage on the
    merged prior), into ``RUN/export-STAGE`` by default; None: the run's latest, into
    ``RUN/export``."""
