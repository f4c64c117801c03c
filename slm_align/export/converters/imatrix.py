"""llama.cpp's importance matrix from calibration text, for its low-bit quantizer.

llama.cpp's ``llama-imatrix`` records, for every weight matrix, the mean over tokens of each input
column's squared activation; the quantizer then weighs each column's rounding error by it (K-quants
and IQ types). llama-cpp-python exposes the quantizer's side
(``llama_model_quantize_params.imatrix``, a NULL-terminated array of ``{name, data, size}``) but not
the collection (``llama-imatrix`` is a separate C++ tool, and its eval callback hands out raw
``ggml_tensor`` pointers the bindings do not describe). So the statistic is collected here, with
forward hooks on every ``nn.Linear`` of the PyTorch model the artifact is verified against, and
named as our converter names the tensors. Conv1D (GPT-2) layers get no entry: llama.cpp then
quantizes them without one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from slm_align.ondevice.gguf.architectures import ARCHITECTURES, normalized_config


def activation_importance(model, texts_ids: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Mean squared input activation per input column of every ``nn.Linear``, by module
    name, over ``texts_ids``."""
    import torch

    from slm_align.export.publishing.parity import _token_batch

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def record(name):
        def hook(module, inputs, output):
            rows = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + rows.pow(2).sum(0)
            counts[name] = counts.get(name, 0) + rows.shape[0]
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)]
    try:
        with torch.no_grad():
            for ids in texts_ids:
                model(_token_batch(model, ids))
    finally:
        for handle in handles:
            handle.remove()
    return {name: (sums[name] / counts[name]).cpu().numpy().astype(np.float32) for name in sums}


def gguf_importance(model_dir: Path, importance: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``importance`` under the GGUF tensor names our converter gives ``model_dir``'s
    weights; a tied output projection is llama.cpp's ``token_embd.weight`` (the matrix
    its output matmul reads)."""
    import gguf


    config = normalized_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[config["model_type"]])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", True)
    named = {}
    for module, values in importance.items():
        tensor = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if tensor == "output.weight" and tied:
            tensor = "token_embd.weight"
        if tensor is not None:
            named[tensor] = values
    return named
