"""Our GGUF converter, on gguf-py's writer: HF safetensors directory -> one ``.gguf`` file.

Architectures: Llama (with the Q/K row permutation llama.cpp's rope expects), Qwen2, GPT-NeoX (fused QKV
reordered from per-head to Q|K|V blocks). Types written by this module: F32, F16, Q8_0. Every other llama.cpp
type (Q4_0, Q4_K_M, Q5_K_M, ...) is produced by llama.cpp's own quantizer from an F32 file we write first
(:func:`quantize_gguf`). Files are written to a temporary name and renamed, so a crash never leaves a file that
looks whole.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from slm_align.errors import UserError
from slm_align.export.gguf_vocab import add_vocab
from slm_align.export.gguf_vocab import pre_tokenizer_name as pre_tokenizer_name  # re-exported

ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2", "gpt_neox": "GPTNEOX"}
WRITTEN_TYPES = ("F32", "F16", "Q8_0")
# llama.cpp's quantizer types we expose (names as llama.cpp's `llama-quantize` prints them).
QUANTIZER_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
                   "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS")
GGUF_TYPES = WRITTEN_TYPES + QUANTIZER_TYPES
# Buffers some checkpoints carry that are not weights.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def check_gguf_type(name: str) -> str:
    """``name`` normalised to upper case, or one line listing the choices."""
    if name.upper() not in GGUF_TYPES:
        raise UserError(f"unknown GGUF quantization '{name}'; choose one of {', '.join(GGUF_TYPES)}")
    return name.upper()


def _permute_for_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores Q/K rows in halves per head (rotate_half); llama.cpp's Llama rope expects them interleaved."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unfuse_neox_qkv(weight: np.ndarray, n_head: int) -> np.ndarray:
    """GPT-NeoX interleaves q, k, v per head; llama.cpp's GPT-NeoX graph reads Q, then K, then V blocks."""
    per_head = weight.reshape(n_head, 3, weight.shape[0] // n_head // 3, *weight.shape[1:])
    return np.concatenate([per_head[:, part].reshape(-1, *weight.shape[1:]) for part in range(3)], axis=0)


def _head_counts(config: dict) -> tuple[int, int]:
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads") or heads


def _transform(model_type: str, config: dict) -> Callable[[str, np.ndarray], np.ndarray]:
    """The per-tensor rewrite an architecture needs before llama.cpp can read its weights."""
    heads, kv_heads = _head_counts(config)

    def transform(name: str, data: np.ndarray) -> np.ndarray:
        if model_type == "llama" and name.endswith("q_proj.weight"):
            return _permute_for_rope(data, heads)
        if model_type == "llama" and name.endswith("k_proj.weight"):
            return _permute_for_rope(data, kv_heads)
        if model_type == "gpt_neox" and "query_key_value" in name:
            return _unfuse_neox_qkv(data, heads)
        return data

    return transform


def _add_hparams(writer, model_type: str, config: dict) -> None:
    heads, kv_heads = _head_counts(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rotary_emb_base") or 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    if model_type == "gpt_neox":
        rotary = config.get("partial_rotary_factor") or config.get("rotary_pct") or 1.0
        writer.add_rope_dimension_count(int(rotary * head_dim))
        writer.add_parallel_residual(bool(config.get("use_parallel_residual", True)))
        writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-5)))
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))


def _add_tensor(writer, name: str, data: np.ndarray, file_type: str) -> None:
    """Norms and biases stay F32 (llama.cpp expects it); matrices take the file's type where their rows allow."""
    import gguf

    if data.ndim < 2 or file_type == "F32":
        writer.add_tensor(name, data)
    elif file_type == "Q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:  # F16, or Q8_0 rows that do not split into 32-value blocks (llama.cpp's converter does the same)
        writer.add_tensor(name, data.astype(np.float16))


def _load_state(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no .safetensors weights; save the model with save_pretrained first")
    state: dict[str, np.ndarray] = {}
    for file in files:
        state.update(load_file(file))
    return state


def write_gguf(model_dir: Path, out_path: Path, file_type: str = "F32",
               chat_template: Optional[str] = None) -> Path:
    """Convert a saved HF checkpoint (safetensors + tokenizer) into ``out_path`` (F32, F16 or Q8_0).

    ``chat_template`` overrides (or supplies) the template written into the file.
    """
    import gguf

    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(f"GGUF export does not support architecture '{model_type}' yet; "
                        f"supported: {', '.join(ARCHITECTURES)}")
    if file_type not in WRITTEN_TYPES:
        raise UserError(f"write_gguf writes {', '.join(WRITTEN_TYPES)}; {file_type} goes through quantize_gguf")
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    transform = _transform(model_type, config)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if file_type == "F32" else f"MOSTLY_{file_type}"))
    _add_hparams(writer, model_type, config)
    add_vocab(writer, model_dir, config["vocab_size"], chat_template)
    for name, tensor in _load_state(model_dir).items():
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise UserError(f"GGUF export: no GGUF name for tensor {name}; the checkpoint has unexpected layers")
        _add_tensor(writer, target, transform(name, tensor.astype(np.float32)), file_type)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def quantize_gguf(source: Path, out_path: Path, quant: str, threads: int = 0) -> Path:
    """Quantize an F32/F16 ``source`` GGUF into ``out_path`` with llama.cpp's quantizer (Q4_K_M and friends)."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError(f"GGUF {quant} needs llama.cpp's quantizer: pip install 'slm-align[export]' "
                        "(llama-cpp-python), or export Q8_0/F16 which need nothing more") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = threads
    tmp = Path(out_path).with_name(f".{Path(out_path).name}.tmp")
    try:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama.cpp's quantizer returned {status} for {source} -> {quant}")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return Path(out_path)
