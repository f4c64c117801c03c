"""onnxruntime-genai backend: a genai model folder (``slm-align export --target
genai``) run by genai's decoder.

genai owns the session and the KV cache (``Generator.append_tokens`` runs the graph, ``rewind_to``
drops the tail); we read the logits of every appended position from its ``logits`` output, so the
same sampling loop, greedy check and teacher-forced comparison run on it as on the other backends.
Text goes through ``tokenizer.json`` with the ``tokenizers`` library like
:class:`~slm_align.ondevice.agent.onnx_backend.OnnxBackend`; genai's own tokenizer is checked against it when
the folder is exported (:func:`slm_align.export.converters.genai.genai_tokenizer_report`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent.onnx_backend import OnnxBackend

CONFIG = "genai_config.json"


def genai_model(folder: Path, threads: Optional[int] = None):
    """genai's ``Model`` of ``folder``, its decoder session limited to ``threads``
    intra-op threads when given."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise UserError("genai folders need onnxruntime-genai: pip "
                        "install 'slm-align[export]'") from None
    config = og.Config(str(folder))
    if threads:
        options = {"intra_op_num_threads": int(threads), "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


class GenaiBackend(OnnxBackend):
    """One genai generator (its KV cache) over a genai folder. Not thread-safe: one
    conversation at a time."""

    kind = "genai"

    def __init__(self, artifact: Path, threads: Optional[int] = None, n_ctx: Optional[int] = None):
        from tokenizers import Tokenizer

        artifact = Path(artifact)
        if not (artifact / CONFIG).is_file() or not (artifact / "tokenizer.json").is_file():
            raise UserError(f"{artifact} is not a genai folder (needs {CONFIG} and tokenizer.json); "
                            "create one with `slm-align export --target genai`")
        self.model = genai_model(artifact, threads)
        self.tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
        self._read_settings(artifact, n_ctx)
        context = json.loads((artifact / CONFIG).read_text(encoding="utf-8"))["model"]["context_length"]
        self.n_ctx = min(self.n_ctx, int(context))  # genai refuses a longer max_length
        self.reset()

    def reset(self) -> None:
        """A fresh generator: the next ``feed`` starts a new sequence."""
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.n_ctx, do_sample=False)
        self.generator = og.Generator(self.model, params)
        self.tokens: list[int] = []

    def rewind(self, keep: int) -> None:
        """Keep the cache of the first ``keep`` tokens only (a new prompt that
        shares them reuses it)."""
        if keep == 0:
            self.reset()
        elif keep < len(self.tokens):
            self.generator.rewind_to(keep)
            self.tokens = self.tokens[:keep]

    def feed_all(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids`` to the sequence; the logits at each of their positions,
        shape (len(ids), vocab)."""
        if not ids:
            raise ValueError("feed needs at least one token")
        if self.n_past + len(ids) > self.n_ctx:
            raise UserError(f"context window of {self.n_ctx} tokens exceeded; "
                            "start a new conversation")
        self.generator.append_tokens(np.asarray(ids, dtype=np.int32))
        self.tokens.extend(int(i) for i in ids)
        logits = np.asarray(self.generator.get_output("logits"))
        return logits[0, -len(ids):].astype(np.float32, copy=False)
