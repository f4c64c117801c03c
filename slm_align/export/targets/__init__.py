"""Export targets, one class per ``--target``, each registered once here (the registry is
:data:`~slm_align.export.targets.base.REGISTRY`). A new target: its file, and its line below."""

from slm_align.export.targets.base import REGISTRY, ExportTarget, register, target_named
from slm_align.export.targets.executorch import ExecutorchTarget
from slm_align.export.targets.genai import GenaiTarget
from slm_align.export.targets.gguf import GgufTarget
from slm_align.export.targets.gguf_adapter import GgufAdapterTarget
from slm_align.export.targets.onnx import OnnxTarget

register(GgufTarget())
register(GgufAdapterTarget())
register(OnnxTarget())
register(GenaiTarget())
register(ExecutorchTarget())

__all__ = ["REGISTRY", "ExportTarget", "register", "target_named"]
