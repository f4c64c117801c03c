"""What the runtime needs from a model (:class:`Backend`), and which kind of artifact a path is."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Protocol, Sequence

import numpy as np

from slm_align.errors import UserError


class Backend(Protocol):
    """What the runtime needs from a model: its tokenizer, its template, and
    logits with a KV cache."""

    kind: str
    n_ctx: int
    vocab_size: int
    eos_ids: set
    chat_template: Optional[str]
    chat_template_origin: Optional[str]
    """Recorded with each turn: "artifact" (the model's own), "chatml" or a template file
    (``--chat-template``)."""
    bos_token: Optional[str]
    eos_token: Optional[str]

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """Token ids of ``text``: ``add_special`` adds BOS; ``special`` parses
        special-token text (``<|im_end|>``) as the special token (False: as the characters
        it is, for message contents)."""

    def detokenize(self, ids: Sequence[int]) -> str: ...
    def reset(self) -> None: ...
    def feed(self, ids: Sequence[int]) -> np.ndarray: ...
    def feed_all(self, ids: Sequence[int]) -> np.ndarray: ...
    def generate(self, prompt: Sequence[int], params, grammar: Optional[str] = None) -> Iterator[int]: ...
    def last_logits(self) -> np.ndarray:
        """Inside ``generate``: the logits the token just yielded was drawn from."""


def artifact_kind(artifact: Path) -> str:
    """``gguf`` for a .gguf file, ``onnx`` for an export directory with model.onnx/model.ort."""
    artifact = Path(artifact)
    if artifact.is_file() and artifact.suffix.lower() == ".gguf":
        return "gguf"
    if artifact.is_dir() and any((artifact / name).is_file() for name in ("model.onnx", "model.ort")):
        return "onnx"
    raise UserError(f"{artifact} is not an exported model; pass a .gguf file or an ONNX export directory "
                    "(`slm-align export` writes both)")
