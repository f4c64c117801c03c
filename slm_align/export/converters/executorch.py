"""An ExecuTorch program (``model.pte``) of a decoder-only LM: fp32,
XNNPACK-delegated, with a static KV cache.

optimum-executorch pins transformers 5, which optimum-onnx cannot run beside, so the program is
built from the pieces it uses: transformers 4.57's ``TorchExportableModuleForDecoderOnlyLM`` (the
model with a static cache of ``max_cache_len`` positions, ``forward(input_ids (1, 1), cache_position
(1,)) -> logits (1, 1, vocab)``), ``torch.export``, ExecuTorch's ``to_edge_transform_and_lower``
with the ``XnnpackPartitioner`` and ``to_executorch``. The program also carries the constant methods
ExecuTorch's LLM runners read (``get_max_seq_len``, ``get_vocab_size``, ``get_bos_id``,
``get_eos_ids``, ``use_kv_cache``). The tokenizer files, the chat template and ``config.json`` are
copied beside it. Only fp32: quantized programs are not built.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from slm_align.errors import UserError

MODEL_FILE = "model.pte"
MAX_CACHE_LEN = 512
"""Positions of the static KV cache (the longest sequence the program decodes): the
verification's context."""
QUANTS = ("fp32",)
EXECUTORCH_TYPES = ("llama", "qwen2", "qwen3", "gpt_neox", "gpt2")
"""model_type values whose tiny test models decode exactly as PyTorch. Gemma 3 is left out:
a tiny one lowers (in 112 s on this 2-core host) but its program fails in ExecuTorch's
runtime (``method->execute() failed with error 0x12``), and the real 270M's lowering did
not finish in 20 minutes."""
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "config.json", "generation_config.json")


def check_executorch_quant(quant: str) -> str:
    """``quant`` when a program of it is built, else one line saying only fp32 is."""
    if quant not in QUANTS:
        raise UserError(f"--target executorch --quant {quant}: only fp32 programs are built; pass "
                        "--quant fp32 (or export --target gguf/onnx/genai for quantized "
                        "artifacts)")
    return quant


def check_executorch_architecture(model_type) -> str:
    """``model_type`` when this path exports it, else one line naming the ones it does."""
    if model_type not in EXECUTORCH_TYPES:
        raise UserError(f"--target executorch: architecture {model_type} is not supported "
                        f"(supported: {', '.join(EXECUTORCH_TYPES)}); export "
                        "--target gguf or onnx instead")
    return model_type


def _import_executorch():
    """ExecuTorch's lowering entry point and XNNPACK partitioner, or one line
    saying how to install them."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
    except ImportError:
        raise UserError("--target executorch needs ExecuTorch: pip install "
                        "'slm-align[executorch]'") from None
    return to_edge_transform_and_lower, XnnpackPartitioner


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _constant_methods(model, max_cache_len: int) -> dict:
    """The metadata ExecuTorch's LLM runners (``extension/llm/runner``) read from the program."""
    bos = model.config.bos_token_id
    return {"get_max_seq_len": max_cache_len, "get_vocab_size": model.config.vocab_size,
            "get_bos_id": bos if bos is not None else -1, "get_eos_ids": _eos_ids(model),
            "use_kv_cache": True, "enable_dynamic_shape": False, "get_max_batch_size": 1}


def _exported_program(model, max_cache_len: int):
    """``torch.export`` of the model with a static cache: one token and its position per call."""
    import torch
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static",
                                               cache_config={"batch_size": 1,
                                                             "max_cache_len": max_cache_len})
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1,
                                                    max_cache_len=max_cache_len)
    return wrapper.export(input_ids=torch.tensor([[0]], dtype=torch.long),
                          cache_position=torch.tensor([0], dtype=torch.long))


def write_executorch(model_dir: Path, out_dir: Path, max_cache_len: int = MAX_CACHE_LEN) -> Path:
    """Lower the HF checkpoint ``model_dir`` into ``out_dir/model.pte`` with its
    tokenizer files; returns the .pte.

    An architecture ``torch.export`` or the lowering cannot take is refused in
    one line (nothing kept)."""
    from slm_align.modeling.models import load_model, resolve_source

    lower, partitioner = _import_executorch()
    model = load_model(resolve_source(str(model_dir)))
    try:
        exported = _exported_program(model, max_cache_len)
        program = lower(exported, partitioner=[partitioner()],
                        constant_methods=_constant_methods(model, max_cache_len)).to_executorch()
    except Exception as exc:  # torch.export's and ExecuTorch's failures have many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--target executorch: {model.config.model_type} did not "
                        f"export ({first[:200]})") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODEL_FILE).write_bytes(program.buffer)
    for copied in COPIED:
        if (Path(model_dir) / copied).is_file():
            shutil.copy2(Path(model_dir) / copied, out_dir / copied)
    settings = {"max_cache_len": max_cache_len, "inputs": ["input_ids (1, 1) int64",
                                                           "cache_position (1,) int64"],
                "outputs": ["logits (1, 1, vocab) float32"]}
    (out_dir / "executorch_config.json").write_text(json.dumps(settings, indent=2) + "\n",
                                                    encoding="utf-8")
    return out_dir / MODEL_FILE
