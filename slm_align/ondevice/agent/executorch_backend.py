"""ExecuTorch backend: a ``model.pte`` (``slm-align export --target executorch``) run by
ExecuTorch's Python runtime.

The program holds a static KV cache of ``get_max_seq_len`` positions as mutable buffers and takes
one token and its position per call (``forward(input_ids (1, 1), cache_position (1,)) -> logits (1,
1, vocab)``); positions after the current one are masked, so a reset or a rewind only moves the
position back. Text goes through ``tokenizer.json`` with the ``tokenizers`` library like
:class:`~slm_align.ondevice.agent.onnx_backend.OnnxBackend`, and the same sampling loop, greedy check and
teacher-forced comparison run on it as on the other backends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent.onnx_backend import OnnxBackend

MODEL_FILE = "model.pte"


def _runtime():
    try:
        from executorch.runtime import Runtime
    except ImportError:
        raise UserError(".pte programs need ExecuTorch: pip install "
                        "'slm-align[executorch]'") from None
    return Runtime.get()


class ExecutorchBackend(OnnxBackend):
    """One loaded ``forward`` method (its KV cache). Not thread-safe: one conversation at a time."""

    kind = "executorch"

    def __init__(self, artifact: Path, threads: Optional[int] = None, n_ctx: Optional[int] = None):
        from tokenizers import Tokenizer

        artifact = Path(artifact)
        if not (artifact / MODEL_FILE).is_file() or not (artifact / "tokenizer.json").is_file():
            raise UserError(f"{artifact} is not an ExecuTorch export (needs {MODEL_FILE} and tokenizer.json); "
                            "create one with `slm-align export --target executorch`")
        if threads:
            from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

            _unsafe_reset_threadpool(int(threads))
        program = _runtime().load_program(artifact / MODEL_FILE)
        self.method = program.load_method("forward")
        capacity = int(program.load_method("get_max_seq_len").execute([])[0])
        self.tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
        self._read_settings(artifact, n_ctx)
        self.n_ctx = min(self.n_ctx, capacity)  # the static cache has no room beyond it
        self.reset()

    def reset(self) -> None:
        """Position 0: the next ``feed`` starts a new sequence (the stale
        cache beyond it is masked)."""
        self.tokens: list[int] = []

    def rewind(self, keep: int) -> None:
        """Keep the cache of the first ``keep`` tokens only (a new prompt that
        shares them reuses it)."""
        self.tokens = self.tokens[:keep]

    def feed_all(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids`` to the sequence, one call per token; the logits at each of their
        positions, shape (len(ids), vocab)."""
        import torch

        if not ids:
            raise ValueError("feed needs at least one token")
        if self.n_past + len(ids) > self.n_ctx:
            raise UserError(f"context window of {self.n_ctx} tokens exceeded; "
                            "start a new conversation")
        rows = []
        for token in ids:
            inputs = [torch.tensor([[int(token)]], dtype=torch.long), torch.tensor([self.n_past], dtype=torch.long)]
            rows.append(self.method.execute(inputs)[0][0, -1].numpy().astype(np.float32, copy=True))
            self.tokens.append(int(token))
        return np.stack(rows)
