"""Our GGUF converter, on gguf-py's writer: HF safetensors directory -> one ``.gguf`` file.

Architectures: Llama (with the Q/K row permutation llama.cpp's rope expects), Qwen2, Qwen3 (q/k
norms, explicit head_dim), Gemma 3 text (norm weights written as 1 + w, llama.cpp's (1+w) convention
baked in; tied output), GPT-NeoX (fused QKV reordered from per-head to Q|K|V blocks) and GPT-2
(Conv1D weights transposed to Linear layout; learned positions; tied output). A config that
llama.cpp would run differently from transformers (a Gemma 3 layer pattern other than every sixth
layer global, for one) is refused before anything is written. Types written by this module: F32,
F16, Q8_0. Every other llama.cpp type (Q4_0, Q4_K_M, Q5_K_M, ...) is produced by llama.cpp's own
quantizer from an F32 file we write first (:func:`quantize_gguf`). Files are written to a temporary
name and renamed, so a crash never leaves a file that looks whole.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from slm_align.atomic import atomic_path
from slm_align.errors import UserError
from slm_align.ondevice.gguf.architectures import (
    ARCHITECTURES,
    attention_head_dim,
    check_gguf_config,
    head_counts,
    normalized_config,
)
from slm_align.ondevice.gguf.quantizer_imatrix import imatrix_array
from slm_align.ondevice.gguf.vocab import add_vocab
from slm_align.ondevice.gguf.vocab import pre_tokenizer_name as pre_tokenizer_name  # re-exported

WRITTEN_TYPES = ("F32", "F16", "Q8_0")
# llama.cpp's quantizer types we expose (names as llama.cpp's `llama-quantize` prints them).
QUANTIZER_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
                   "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS")
GGUF_TYPES = WRITTEN_TYPES + QUANTIZER_TYPES
# Buffers some checkpoints carry that are not weights.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias", ".attn.bias",
                     ".attn.masked_bias")
# GPT-2 stores these as Conv1D (in_features, out_features); llama.cpp reads Linear's (out, in).
_CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def check_gguf_type(name: str) -> str:
    """``name`` normalised to upper case, or one line listing the choices."""
    if name.upper() not in GGUF_TYPES:
        raise UserError(f"unknown GGUF quantization '{name}'; choose one of "
                        f"{', '.join(GGUF_TYPES)}")
    return name.upper()


def _permute_for_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores Q/K rows in halves per head (rotate_half); llama.cpp's Llama rope
    expects them interleaved."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unfuse_neox_qkv(weight: np.ndarray, n_head: int) -> np.ndarray:
    """GPT-NeoX interleaves q, k, v per head; llama.cpp's GPT-NeoX graph reads Q,
    then K, then V blocks."""
    per_head = weight.reshape(n_head, 3, weight.shape[0] // n_head // 3, *weight.shape[1:])
    return np.concatenate([per_head[:, part].reshape(-1, *weight.shape[1:]) for part in range(3)],
                          axis=0)


def row_reordering(model_type: str, config: dict) -> Callable[[str, np.ndarray], np.ndarray]:
    """The reordering of output rows llama.cpp needs for an architecture's weights (Llama's Q/K rope
    interleave, GPT-NeoX's fused QKV regrouped), by HF tensor name: applies to any array whose first
    axis is that weight's rows, so a LoRA adapter's B ``(out, r)`` takes the same reordering as
    W ``(out, in)`` (P W + P B A = P (W + B A))."""
    heads, kv_heads = head_counts(config)

    def reorder(name: str, data: np.ndarray) -> np.ndarray:
        if model_type == "llama" and name.endswith("q_proj.weight"):
            return _permute_for_rope(data, heads)
        if model_type == "llama" and name.endswith("k_proj.weight"):
            return _permute_for_rope(data, kv_heads)
        if model_type == "gpt_neox" and "query_key_value" in name:
            return _unfuse_neox_qkv(data, heads)
        return data

    return reorder


def is_conv1d_weight(model_type: str, name: str) -> bool:
    """GPT-2's Conv1D weights, stored (in, out) where llama.cpp reads Linear's (out, in)."""
    return model_type == "gpt2" and name.endswith(_CONV1D_WEIGHTS)


def gguf_arch_name(model_type: str) -> str:
    """llama.cpp's architecture name (``general.architecture``) of an HF model type we write."""
    import gguf

    return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])]


def gguf_namer(model_type: str, config: dict) -> Callable[[str], Optional[str]]:
    """The GGUF name of an HF tensor name (``model.layers.0.self_attn.q_proj.weight`` ->
    ``blk.0.attn_q.weight``), None for a tensor llama.cpp has no name for."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    return lambda name: names.get_name(name, try_suffixes=(".weight", ".bias"))


def _transform(model_type: str, config: dict) -> Callable[[str, np.ndarray], np.ndarray]:
    """The per-tensor rewrite an architecture needs before llama.cpp can read its weights."""
    reorder = row_reordering(model_type, config)

    def transform(name: str, data: np.ndarray) -> np.ndarray:
        data = reorder(name, data)
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            # Gemma3RMSNorm computes x * (1 + w); llama.cpp computes x * w
            return data + np.float32(1.0)
        if is_conv1d_weight(model_type, name):
            return np.ascontiguousarray(data.T)
        return data

    return transform


def _add_rms_hparams(writer, model_type: str, config: dict) -> None:
    """Llama, Qwen and Gemma: grouped-query attention, rope over the whole head, RMSNorm."""
    head_dim = attention_head_dim(config)
    writer.add_head_count_kv(head_counts(config)[1])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if model_type == "gemma3_text":
        _add_gemma3_hparams(writer, config)


def _add_gemma3_hparams(writer, config: dict) -> None:
    """Sliding window (llama.cpp derives the layer pattern), the sliding layers' rope base, final
    logit cap and linear rope scaling (global layers)."""
    import gguf

    writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_float32(f"{writer.arch}.rope.freq_base_swa",
                       float(config.get("rope_local_base_freq", 10000.0)))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


def _add_gpt_neox_hparams(writer, config: dict) -> None:
    rotary = config.get("partial_rotary_factor") or config.get("rotary_pct") or 1.0
    writer.add_rope_dimension_count(int(rotary * attention_head_dim(config)))
    writer.add_parallel_residual(bool(config.get("use_parallel_residual", True)))
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-5)))


def _add_hparams(writer, model_type: str, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    if model_type == "gpt2":  # learned positions, no rope
        writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
        return
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rotary_emb_base")
                                    or 10000.0))
    if model_type == "gpt_neox":
        _add_gpt_neox_hparams(writer, config)
    else:
        _add_rms_hparams(writer, model_type, config)


def _add_tensor(writer, name: str, data: np.ndarray, file_type: str) -> None:
    """Norms, biases and learned positions stay F32 (as llama.cpp's converter and quantizer keep
    them); matrices take the file's type where their rows allow."""
    import gguf

    if data.ndim < 2 or file_type == "F32" or name == "position_embd.weight":
        writer.add_tensor(name, data)
    elif file_type == "Q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:
        # F16, or Q8_0 rows that do not split into 32-value blocks (llama.cpp's converter does the
        # same)
        writer.add_tensor(name, data.astype(np.float16))


def skipped_tensor(name: str) -> bool:
    """A checkpoint buffer that is not a weight (rotary frequencies, causal masks)."""
    return name.endswith(_SKIPPED_SUFFIXES)


def _load_state(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no .safetensors weights; save the model with "
                        f"save_pretrained first")
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

    model_dir = Path(model_dir)
    out_path = Path(out_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    check_gguf_config(config)
    config = normalized_config(config)
    model_type = config["model_type"]
    if file_type not in WRITTEN_TYPES:
        raise UserError(f"write_gguf writes {', '.join(WRITTEN_TYPES)}; {file_type} "
                        "goes through quantize_gguf")
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    with atomic_path(out_path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
        _fill(writer, model_dir, model_type, config, file_type, chat_template)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out_path


def _fill(writer, model_dir: Path, model_type: str, config: dict, file_type: str,
          chat_template: Optional[str]) -> None:
    """Add the name, file type, hyper-parameters, vocabulary and every tensor (renamed for
    llama.cpp) to ``writer``."""
    import gguf

    names = gguf_namer(model_type, config)
    transform = _transform(model_type, config)
    writer.add_name(model_dir.name)
    writer.add_file_type(getattr(gguf.LlamaFileType,
                                 "ALL_F32" if file_type == "F32" else f"MOSTLY_{file_type}"))
    _add_hparams(writer, model_type, config)
    add_vocab(writer, model_dir, config["vocab_size"], chat_template)
    for name, tensor in _load_state(model_dir).items():
        if skipped_tensor(name):
            continue
        target = names(name)
        if target is None:
            raise UserError(f"GGUF export: no GGUF name for tensor {name}; the "
                            "checkpoint has unexpected layers")
        _add_tensor(writer, target, transform(name, tensor.astype(np.float32)), file_type)


def quantize_gguf(source: Path, out_path: Path, quant: str, threads: int = 0,
                  importance: Optional[dict[str, np.ndarray]] = None) -> Path:
    """Quantize an F32/F16 ``source`` GGUF into ``out_path`` with llama.cpp's quantizer (Q4_K_M and
    friends), weighting rounding errors by ``importance`` (an importance matrix by GGUF tensor name,
    see imatrix.py) if given."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError(f"GGUF {quant} needs llama.cpp's quantizer: pip install "
                        "'slm-align[export]' (llama-cpp-python), or export Q8_0/F16 which need "
                        "nothing more") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = threads
    # the buffers stay referenced until the quantizer returns
    entries, _buffers = imatrix_array(importance)
    if entries is not None:
        params.imatrix = entries
    with atomic_path(out_path) as tmp:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                                ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama.cpp's quantizer returned {status} for {source} -> {quant}")
    return Path(out_path)
