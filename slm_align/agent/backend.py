"""Open an exported artifact with the backend that runs it, and the greedy loop both backends share."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Protocol, Sequence

import numpy as np

from slm_align.errors import UserError


class Backend(Protocol):
    """What the runtime needs from a model: its tokenizer, its template, and logits with a KV cache."""

    kind: str
    n_ctx: int
    vocab_size: int
    eos_ids: set
    chat_template: Optional[str]
    chat_template_origin: Optional[str]
    """Recorded with each turn: "artifact" (the model's own), "chatml" or a template file (``--chat-template``)."""
    bos_token: Optional[str]
    eos_token: Optional[str]

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """Token ids of ``text``: ``add_special`` adds BOS; ``special`` parses special-token text (``<|im_end|>``)
        as the special token (False: as the characters it is, for message contents)."""

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


def open_backend(artifact: Path, threads: Optional[int] = None, n_ctx: Optional[int] = None,
                 all_logits: bool = False) -> Backend:
    """The backend for ``artifact``: llama.cpp for GGUF, onnxruntime for ONNX."""
    if artifact_kind(artifact) == "gguf":
        from slm_align.agent.llama_backend import LlamaCppBackend

        return LlamaCppBackend(artifact, threads=threads, n_ctx=n_ctx, all_logits=all_logits)
    from slm_align.agent.onnx_backend import OnnxBackend

    return OnnxBackend(artifact, threads=threads, n_ctx=n_ctx)


def greedy(backend: Backend, prompt: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Greedy continuation of ``prompt`` from an empty cache."""
    backend.reset()
    logits = backend.feed(list(prompt))
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        token = int(np.argmax(logits))
        tokens.append(token)
        if stop_at_eos and token in backend.eos_ids or len(tokens) == max_new_tokens:
            break
        logits = backend.feed([token])
    return tokens


def numpy_generate(backend, prompt: Sequence[int], params) -> Iterator[int]:
    """Our sampling loop over ``feed``: the cache of the prompt's prefix seen before is kept, the rest fed."""
    from slm_align.agent.sampling import sample_token

    prompt = list(prompt)
    shared = 0
    for seen, new in zip(backend.tokens, prompt[:-1]):  # the last prompt token is fed again for its logits
        if seen != new:
            break
        shared += 1
    backend.rewind(shared)
    rng = np.random.default_rng(params.seed)
    logits = backend.feed(prompt[shared:])
    generated: list[int] = []
    while True:
        token = sample_token(logits, params, rng, generated)
        generated.append(token)
        yield token
        logits = backend.feed([token])
