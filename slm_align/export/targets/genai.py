"""``--target genai``: the ONNX export plus its ``genai_config.json``, verified through
onnxruntime-genai itself, its own tokenizer included."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from slm_align.export.converters.genai import (
    check_genai_architecture,
    genai_tokenizer_report,
    write_genai_config,
)
from slm_align.export.targets.onnx import OnnxTarget


class GenaiTarget(OnnxTarget):
    name = "genai"

    def check_architecture(self, model_type: Callable[[], Optional[str]]) -> None:
        check_genai_architecture(model_type())  # GPT-NeoX, GPT-2: refused before any work

    def build(self, checkpoint: Path, scratch: Path, quant: str, settings: dict) -> Path:
        from slm_align.ondevice.agent.settings import SamplingParams

        built = super().build(checkpoint, scratch, quant, settings)
        write_genai_config(built, SamplingParams().to_dict())
        return built

    def open_backend(self, artifact: Path, threads: int, n_ctx: int):
        from slm_align.ondevice.agent.genai_backend import GenaiBackend

        return GenaiBackend(artifact, threads=threads, n_ctx=n_ctx)

    def check_backend(self, report: dict, backend, tokenizer, artifact: Path) -> None:
        """genai's own tokenizer must split the verification texts and render the chats as the
        model's does (:func:`~slm_align.export.converters.genai.genai_tokenizer_report`)."""
        from transformers import AutoTokenizer

        from slm_align.export.publishing.parity import HELDOUT_TEXT, RAW_TEXTS, USER_MESSAGES

        chats = [[{"role": "user", "content": message}] for message in USER_MESSAGES]
        texts = list(RAW_TEXTS) + [HELDOUT_TEXT]
        own = AutoTokenizer.from_pretrained(artifact)
        report.update(genai_tokenizer_report(backend.model, tokenizer, texts, chats, own))
        report["passed"] = report["passed"] and report["genai_tokenizer_match"]
