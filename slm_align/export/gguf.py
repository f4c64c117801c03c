"""Our GGUF converter, on gguf-py's writer: HF safetensors directory -> one ``.gguf`` file.

Supported now: Llama (with the Q/K row permutation llama.cpp's rope expects) and Qwen2. Types: F32 and F16
(Q8_0 and the llama.cpp quantizer types arrive with the export issue). Written to a temporary name and
renamed, so a crash never leaves a file that looks whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from slm_align.errors import UserError

ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}
FILE_TYPES = {"F32": 0, "F16": 1}


def _permute_for_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores Q/K rows in halves per head (rotate_half); llama.cpp's Llama rope expects them interleaved."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_hparams(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])


def _add_vocab(writer, model_dir: Path, vocab_size: int) -> None:
    """GPT-2 style byte-level BPE: tokens, types (special tokens as CONTROL), merges, special ids, template."""
    import gguf

    try:
        vocab = gguf.BpeVocab(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"{model_dir}: no byte-level BPE tokenizer.json to convert ({exc}); "
                        "GGUF export needs the model's fast tokenizer") from None
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    special = {item["id"] for item in tokenizer_json.get("added_tokens", []) if item.get("special")}
    tokens, types = [], []
    for index, (text, _score, kind) in enumerate(vocab.all_tokens()):
        tokens.append(text)
        types.append(gguf.TokenType.CONTROL if index in special else kind)
    for index in range(len(tokens), vocab_size):  # embedding rows beyond the tokenizer: padding tokens
        tokens.append(f"[PAD{index}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if "bos" not in special_vocab.special_token_ids and "eos" in special_vocab.special_token_ids:
        special_vocab.special_token_ids["bos"] = special_vocab.special_token_ids["eos"]
    special_vocab.add_to_gguf(writer, quiet=True)
    if "bos" not in special_vocab.add_special_token:  # say it explicitly: readers default differently
        writer.add_add_bos_token(bool(_adds_bos(model_dir)))


def _adds_bos(model_dir: Path) -> bool:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return bool(tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id])


def write_gguf(model_dir: Path, out_path: Path, file_type: str = "F32") -> Path:
    """Convert a saved HF checkpoint (safetensors + tokenizer) into ``out_path``."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(f"GGUF export does not support architecture '{model_type}' yet; "
                        f"supported: {', '.join(ARCHITECTURES)}")
    if file_type not in FILE_TYPES:
        raise UserError(f"unknown GGUF type {file_type}; choose one of {', '.join(FILE_TYPES)}")
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    writer.add_file_type(FILE_TYPES[file_type])
    _add_hparams(writer, config)
    _add_vocab(writer, model_dir, config["vocab_size"])
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(file))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for name, tensor in state.items():
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise UserError(f"GGUF export: no GGUF name for tensor {name}; the checkpoint has unexpected layers")
        data = tensor.astype(np.float32)
        if model_type == "llama" and name.endswith("q_proj.weight"):
            data = _permute_for_rope(data, heads)
        elif model_type == "llama" and name.endswith("k_proj.weight"):
            data = _permute_for_rope(data, kv_heads)
        if file_type == "F16" and data.ndim > 1:
            data = data.astype(np.float16)
        writer.add_tensor(target, data)
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
