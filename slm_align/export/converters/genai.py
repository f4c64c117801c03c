"""An onnxruntime-genai model folder from our ONNX export: the folder plus the
``genai_config.json`` genai reads.

onnxruntime-genai's own model builder (``python -m onnxruntime_genai.models.builder``, 0.18) imports
classes that only transformers 5 has (``Qwen3_5ForConditionalGeneration``), while optimum-onnx holds
transformers at 4.57, and it serves neither GPT-NeoX nor GPT-2; so the folder is our parity-checked
ONNX export (optimum's ``input_ids``/``attention_mask``/``position_ids``/``past_key_values.N.key``
-> ``logits``/``present.N.key`` graph, which genai's decoder reads as is) with the config written
beside it. Greedy decoding through genai's Python API is compared with PyTorch's by
:func:`genai_greedy`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from slm_align.errors import UserError

CONFIG = "genai_config.json"
GENAI_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3_text"}
"""model_type -> genai's model type, for the architectures this path is tested on."""


def _first(value):
    """A token id, or the first of a list of them."""
    if isinstance(value, list):
        return value[0]
    return value


def _token_id(config: dict, name: str) -> int:
    """``name`` from the config, falling back to the end-of-sequence token."""
    value = _first(config.get(name))
    if value is None:
        value = _first(config["eos_token_id"])
    return int(value)


def _decoder(config: dict) -> dict:
    heads = config["num_attention_heads"]
    return {"filename": "model.onnx", "head_size": config.get("head_dim")
            or config["hidden_size"] // heads, "hidden_size": config["hidden_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": config.get("num_key_value_heads") or heads,
            "num_hidden_layers": config["num_hidden_layers"],
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                       "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                       "past_value_names": "past_key_values.%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value"}}


def check_genai_architecture(model_type: Optional[str]) -> str:
    """``model_type`` when genai's decoder runs it, else one line naming the ones it does."""
    if model_type not in GENAI_TYPES:
        raise UserError(f"--target genai: architecture {model_type} is not supported (supported: "
                        f"{', '.join(GENAI_TYPES)}); export --target gguf or onnx instead")
    return model_type


def genai_config(config: dict, sampling: dict) -> dict:
    """genai_config.json for an HF ``config`` and our sampling defaults (greedy
    when temperature is 0)."""
    model_type = check_genai_architecture(config.get("model_type"))
    greedy = sampling["temperature"] == 0
    search = {"do_sample": not greedy, "max_length": config.get("max_position_embeddings", 2048),
              "min_length": 0, "num_beams": 1, "num_return_sequences": 1,
              "past_present_share_buffer": False, "repetition_penalty": sampling["repeat_penalty"],
              "temperature": sampling["temperature"] or 1.0, "top_k": sampling["top_k"] or 1,
              "top_p": sampling["top_p"]}
    model = {"type": GENAI_TYPES[model_type], "vocab_size": config["vocab_size"],
             "context_length": config.get("max_position_embeddings", 2048),
             "bos_token_id": _token_id(config, "bos_token_id"),
             "eos_token_id": _token_id(config, "eos_token_id"),
             "pad_token_id": _token_id(config, "pad_token_id"), "decoder": _decoder(config)}
    return {"model": model, "search": search}


def _tokenizer_ids(folder: Path) -> dict:
    """The tokenizer's special token ids, for a config.json that leaves them out."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    return {key: value for key, value in ids.items() if value is not None}


def _drop_null_settings(folder: Path) -> None:
    """tokenizer_config.json without its null entries: genai's tokenizer refuses
    ``"chat_template": null`` (which a base model saved from a .gguf has) with "type must be
    string, but is null"; transformers reads a missing key as it reads null. genai takes the
    template from chat_template.jinja."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return
    settings = json.loads(path.read_text(encoding="utf-8"))
    kept = {key: value for key, value in settings.items() if value is not None}
    if kept != settings:
        path.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_genai_config(folder: Path, sampling: dict) -> Path:
    """Write genai_config.json into an ONNX export folder (its config.json describes the model), and
    make its tokenizer settings readable by genai."""
    _drop_null_settings(folder)
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    config = {**_tokenizer_ids(folder), **{key: value for key, value in config.items()
                                           if value is not None}}
    path = Path(folder) / CONFIG
    path.write_text(json.dumps(genai_config(config, sampling), indent=2) + "\n", encoding="utf-8")
    return path


def genai_tokens(folder: Path, text: str) -> list[int]:
    """How onnxruntime-genai's tokenizer splits ``text``."""
    import onnxruntime_genai as og

    return [int(token) for token in og.Tokenizer(og.Model(str(folder))).encode(text)]


def _same_ids(genai: list[int], model: list[int], bos: Optional[int]) -> Optional[bool]:
    """True: equal; False: equal but for the leading BOS the model's tokenizer
    adds; None: different."""
    if genai == model:
        return True
    if bos is not None and model[:1] == [bos] and genai == model[1:]:
        return False
    return None


def genai_tokenizer_report(model, tokenizer, texts: list[str], chats: list[list[dict]],
                           template_tokenizer) -> dict:
    """genai's tokenizer of ``model`` (an ``og.Model``: the tokenizer an app calls) against the
    model's HF ``tokenizer`` on ``texts`` and on ``chats`` rendered by genai's
    ``apply_chat_template`` (when ``template_tokenizer``, the artifact's, has a template).

    ``genai_tokenizer_match``: every id sequence equals the model tokenizer's, or equals it but
    for the leading BOS the model's tokenizer adds (``genai_adds_bos`` False: genai's
    ``encode`` leaves BOS to the caller, as 0.18 does for a tokenizer.json whose post-processor
    adds it), and genai renders every chat as transformers does (``genai_chat_template_match``;
    None without a template).
    """
    import onnxruntime_genai as og

    genai = og.Tokenizer(model)
    strings = list(texts)
    rendered = None
    if template_tokenizer.chat_template:
        rendered = [genai.apply_chat_template(json.dumps(chat), add_generation_prompt=True)
                    for chat in chats]
        expected = [template_tokenizer.apply_chat_template(chat, tokenize=False,
                                                           add_generation_prompt=True)
                    for chat in chats]
        strings.extend(rendered)
        rendered = rendered == expected
    same = [_same_ids([int(t) for t in genai.encode(text)], tokenizer(text)["input_ids"],
                      tokenizer.bos_token_id)
            for text in strings]
    return {"genai_tokenizer_match": None not in same and rendered is not False,
            "genai_adds_bos": False not in same, "genai_chat_template_match": rendered}


def genai_greedy(folder: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by onnxruntime-genai."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
    out = []
    while not generator.is_done():
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out
