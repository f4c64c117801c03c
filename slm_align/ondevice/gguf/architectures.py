"""Which architectures our GGUF converter writes, and the configs llama.cpp would run differently
from transformers (refused before any file is written).
"""

from __future__ import annotations

from typing import Optional

from slm_align.errors import UserError

ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3_text": "GEMMA3",
                 "gpt_neox": "GPTNEOX", "gpt2": "GPT2"}
# llama.cpp's Gemma 3 makes every sixth layer global and the rest sliding (it reads no per-layer
# list from files its converter writes).
GEMMA3_GLOBAL_EVERY = 6


def _gpt2_names(config: dict) -> dict:
    """GPT-2's config under the names the other architectures use (so one set of
    hparam writers serves all)."""
    hidden = config["n_embd"]
    return dict(config, hidden_size=hidden, num_hidden_layers=config["n_layer"],
                num_attention_heads=config["n_head"], max_position_embeddings=config["n_positions"],
                intermediate_size=config.get("n_inner") or 4 * hidden,
                layer_norm_eps=config.get("layer_norm_epsilon", 1e-5))


def normalized_config(config: dict) -> dict:
    """A model's config.json with GPT-2's names mapped to the others' (hidden_size,
    num_hidden_layers, ...)."""
    return _gpt2_names(config) if config.get("model_type") == "gpt2" else config


def head_counts(config: dict) -> tuple[int, int]:
    """Attention heads and key/value heads."""
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads") or heads


def attention_head_dim(config: dict) -> int:
    """Width of one attention head."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def gemma3_layer_types(layers: int) -> list[str]:
    """The layer pattern llama.cpp's Gemma 3 graph assumes (it reads no
    per-layer list from our files)."""
    global_layer = GEMMA3_GLOBAL_EVERY - 1
    return ["full_attention" if i % GEMMA3_GLOBAL_EVERY == global_layer else "sliding_attention"
            for i in range(layers)]


def _gemma3_difference(config: dict) -> Optional[str]:
    """What llama.cpp's Gemma 3 graph would do differently from transformers with
    this config, if anything."""
    layer_types = config.get("layer_types") or gemma3_layer_types(config["num_hidden_layers"])
    if layer_types != gemma3_layer_types(config["num_hidden_layers"]):
        return f"its layer_types are not llama.cpp's pattern (every {GEMMA3_GLOBAL_EVERY}th layer global)"
    if config.get("query_pre_attn_scalar", attention_head_dim(config)) != attention_head_dim(config):
        return "query_pre_attn_scalar differs from head_dim (llama.cpp scales attention by 1/sqrt(head_dim))"
    if config.get("attn_logit_softcapping") is not None:
        return "it caps attention logits (attn_logit_softcapping), which llama.cpp's Gemma 3 does not"
    if config.get("use_bidirectional_attention"):
        return "its attention is bidirectional"
    if (config.get("rope_scaling") or {}).get("rope_type", "linear") != "linear":
        return f"its rope scaling '{config['rope_scaling'].get('rope_type')}' is not linear"
    return None


def _gpt2_difference(config: dict) -> Optional[str]:
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh",
                                                             "gelu_fast"):
        return f"its activation '{config['activation_function']}' is not the tanh GELU llama.cpp uses"
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        return "its attention scaling is not 1/sqrt(head_dim)"
    return None


def _qwen_difference(config: dict) -> Optional[str]:
    if config.get("use_sliding_window") and config.get("sliding_window"):
        return "it uses sliding-window attention, which llama.cpp's Qwen graph does not"
    return None


def _no_difference(config: dict) -> None:
    return None


_DIFFERENCES = {"gemma3_text": _gemma3_difference, "gpt2": _gpt2_difference,
                "qwen2": _qwen_difference, "qwen3": _qwen_difference}


def check_gguf_config(config: dict) -> None:
    """Refuse, in one line, an architecture we cannot write or a config llama.cpp
    would run differently."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(f"GGUF export does not support architecture '{model_type}' yet; supported: "
                        f"{', '.join(ARCHITECTURES)} (--target onnx takes more)")
    difference = _DIFFERENCES.get(model_type, _no_difference)(normalized_config(config))
    if difference is not None:
        raise UserError(f"GGUF export: llama.cpp would run this {model_type} model differently "
                        f"from transformers: {difference}; export to ONNX instead")
