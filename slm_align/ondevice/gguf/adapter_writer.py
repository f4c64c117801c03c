"""A peft LoRA adapter as a llama.cpp LoRA adapter GGUF, bound to the base GGUF it applies to.

The format is the one llama.cpp's ``convert_lora_to_gguf.py`` writes and ``llama_adapter_lora_init``
reads (llama.cpp ``src/llama-adapter.cpp``): ``general.type = "adapter"``,
``adapter.type = "lora"``, ``adapter.lora.alpha``, ``general.architecture`` equal to the base's, and
for each adapted weight ``W`` (GGUF name ``N``, numpy shape ``(out, in)``) two tensors ``N.lora_a``
``(r, in)`` and ``N.lora_b`` ``(out, r)``: peft's own ``lora_A.weight`` and ``lora_B.weight``
layouts. llama.cpp computes ``W x + s * B (A x)`` with ``s = user_scale * alpha / r`` (``r`` read
from B; ``alpha = 0`` means ``s = user_scale``; ``llama_adapter_lora_weight::get_scale``).

Where our GGUF converter (gguf.py) rewrites ``W`` the adapter follows it, so that base + delta in
the file equals the converted merged weight:

- a row reordering ``P`` (Llama's Q/K rope interleave, GPT-NeoX's fused QKV regrouped) goes to B's
  rows: ``P (W + s B A) = P W + s (P B) A``;
- GPT-2's Conv1D transpose needs nothing: peft's A and B for a Conv1D are already in Linear's
  ``(out, in)`` orientation (peft applies ``lora_B(lora_A(x))``, transposing only when merging).

peft scales each module by ``alpha_m / r_m``, or ``alpha_m / sqrt(r_m)`` with rsLoRA (peft
``tuners/lora/layer.py``, ``update_layer``); ``alpha_m`` may come from ``alpha_pattern`` and ``r_m``
from ``rank_pattern``. The file records the config's ``lora_alpha`` and each module's remaining
factor ``peft_scale / (alpha / r_m)`` is folded into its B (1 for plain LoRA: B is copied as saved).

What llama.cpp cannot apply is refused in one line: embedding adapters, a head delta where the head
is tied to the embeddings, DoRA, ``modules_to_save``, trained biases and other peft extras. The file
also records ``slm_align.base.sha256`` of the base GGUF when one is given;
:func:`check_adapter_base` (in the torch-free :mod:`slm_align.ondevice.gguf.adapter_check`,
re-exported here) checks architecture, tensor shapes and that hash before a runtime pairs the two.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import numpy as np

from slm_align.atomic import atomic_path
from slm_align.errors import UserError
from slm_align.ondevice.gguf.adapter_check import BASE_SHA256_KEY, check_adapter_base, check_fits  # noqa: F401 (re-exported)
from slm_align.ondevice.gguf.architectures import (
    ARCHITECTURES,
    check_gguf_config,
    normalized_config,
)
from slm_align.ondevice.gguf.fields import read_header
from slm_align.ondevice.gguf.writer import (
    gguf_arch_name,
    gguf_namer,
    is_conv1d_weight,
    row_reordering,
    skipped_tensor,
)
from slm_align.runs import sha256_file

ADAPTER_TYPES = ("F32", "F16")
_PEFT_PREFIX = "base_model.model."
# peft config entries whose training llama.cpp's LoRA cannot reproduce, and why.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora): llama.cpp applies plain LoRA, not DoRA's magnitude vectors",
    "modules_to_save": "modules_to_save (fully trained modules): merge the adapter and export "
                       "--target gguf instead",
    "lora_bias": "a LoRA bias on B (lora_bias)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "layer_replication": "layer replication, which changes the base's layers",
}


def write_lora_gguf(adapter_dir: Path, base: Path, out_path: Path, file_type: str = "F32",
                    base_gguf: Optional[Path] = None) -> Path:
    """Write the peft adapter in ``adapter_dir`` (adapter_config.json + adapter_model.safetensors)
    as a llama.cpp LoRA GGUF at ``out_path`` (F32 or F16), for ``base``: the HF directory it was
    trained on or a .gguf of it. ``base_gguf`` (default: ``base`` when it is a .gguf) is the file
    the adapter will be applied to: its tensors are checked now and its sha256 recorded for
    :func:`check_adapter_base`."""
    import gguf

    if file_type not in ADAPTER_TYPES:
        raise UserError("a LoRA adapter GGUF is written as "
                        f"{' or '.join(ADAPTER_TYPES)}, not {file_type}")
    adapter_dir, base = Path(adapter_dir), Path(base)
    settings, state = read_peft_adapter(adapter_dir)
    model_type, config, shapes = base_tensors(base)
    if base_gguf is None and base.suffix == ".gguf":
        base_gguf = base
    tensors = llama_cpp_lora(state, settings, model_type, config, shapes)
    if base_gguf is not None:
        shapes_made = {name: (b.shape[0], a.shape[1]) for name, (a, b) in tensors.items()}
        check_fits(shapes_made, gguf_arch_name(model_type), Path(base_gguf))
    with atomic_path(Path(out_path)) as tmp:
        writer = gguf.GGUFWriter(str(tmp), gguf_arch_name(model_type))
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(adapter_dir.name)
        f32 = file_type == "F32"
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(settings.get("lora_alpha") or 0.0))
        if base_gguf is not None:
            writer.add_string(BASE_SHA256_KEY, sha256_file(Path(base_gguf)))
        dtype = np.float32 if file_type == "F32" else np.float16
        for name, (a, b) in tensors.items():
            writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, dtype=dtype))
            writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=dtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(out_path)


def read_peft_adapter(adapter_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A saved peft adapter's config and its tensors in float32 (refused: no adapter, pickle only,
    not LoRA, or a LoRA feature llama.cpp cannot apply)."""
    config_path = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        raise UserError(f"adapter {adapter_dir} needs adapter_config.json and "
                        "adapter_model.safetensors; pass the adapter directory of a finished run "
                        "(save it with safetensors)")
    settings = json.loads(config_path.read_text(encoding="utf-8"))
    if settings.get("peft_type", "LORA") != "LORA":
        raise UserError(f"adapter {adapter_dir} is a {settings['peft_type']} adapter; llama.cpp "
                        "applies LoRA only")
    for key, what in _UNSUPPORTED.items():
        if settings.get(key):
            raise UserError(f"adapter {adapter_dir} uses {what}, "
                            "which a llama.cpp adapter cannot carry")
    if settings.get("bias", "none") != "none":
        raise UserError(f"adapter {adapter_dir} trains biases (bias={settings['bias']}), which a "
                        "llama.cpp adapter cannot carry; train with bias='none' or merge and "
                        "export --target gguf")
    return settings, _load_float32(weights)


def _load_float32(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (bfloat16, which numpy lacks, via torch)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        try:
            return {key: handle.get_tensor(key).astype(np.float32) for key in handle.keys()}
        except TypeError:  # bfloat16
            pass
    from safetensors.torch import load_file

    return {key: value.float().numpy() for key, value in load_file(str(path)).items()}


def base_tensors(base: Path) -> tuple[str, dict, dict[str, tuple[int, ...]]]:
    """The base's HF model type, its (normalized) config and the shapes of the tensors our converter
    writes for it, by GGUF name (numpy order), from an HF directory's headers or a .gguf's header.
    """
    if base.suffix == ".gguf" and base.is_file():
        return _gguf_base(base)
    if not (base / "config.json").is_file():
        raise UserError(f"base model {base} not found (no config.json, not a .gguf); pass the "
                        "model the adapter was trained on")
    from safetensors import safe_open

    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    check_gguf_config(config)
    config = normalized_config(config)
    model_type = config["model_type"]
    namer = gguf_namer(model_type, config)
    shapes = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as handle:
            for key in handle.keys():
                name = None if skipped_tensor(key) else namer(key)
                if name is not None:
                    shape = tuple(handle.get_slice(key).get_shape())
                    shapes[name] = shape[::-1] if is_conv1d_weight(model_type, key) else shape
    if not shapes:
        raise UserError(f"base model {base} has no .safetensors weights; save it with "
                        "save_pretrained first")
    return model_type, config, shapes


def _gguf_base(path: Path) -> tuple[str, dict, dict[str, tuple[int, ...]]]:
    """The config fields name mapping and row reordering need, read from a base .gguf's header."""
    fields, shapes = read_header(path, prefix="")
    arch = fields["general.architecture"].value if "general.architecture" in fields else None
    by_arch = {gguf_arch_name(model_type): model_type for model_type in ARCHITECTURES}
    if arch not in by_arch:
        raise UserError(f"base {path} is a '{arch}' GGUF; LoRA adapters are written for "
                        f"{', '.join(sorted(by_arch))}")
    heads = fields[f"{arch}.attention.head_count"].value
    kv_field = fields.get(f"{arch}.attention.head_count_kv")
    config = {"model_type": by_arch[arch], "num_hidden_layers": fields[f"{arch}.block_count"].value,
              "num_attention_heads": heads,
              "num_key_value_heads": kv_field.value if kv_field else heads}
    return by_arch[arch], config, shapes


def lora_pairs(state: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """peft's tensors as ``{HF weight name: (A (r, in), B (out, r))}``; anything else refused."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in state.items():
        if ".lora_embedding_" in key:
            raise UserError(f"the adapter adapts an embedding ({_module(key)}); llama.cpp applies "
                            "LoRA to matrix products only: train without the embedding in "
                            "target_modules")
        if ".lora_magnitude_vector" in key:
            raise UserError(f"the adapter is DoRA ({_module(key)}); "
                            "llama.cpp applies plain LoRA only")
        if key.endswith(".base_layer.weight"):
            continue  # the frozen base weight of a targeted head, which peft saves beside the LoRA
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key)
        if match is None:
            raise UserError(f"the adapter holds {key}, which is not a LoRA A/B matrix (a fully "
                            "trained module or bias); a llama.cpp adapter cannot carry it")
        name = match.group(1).removeprefix(_PEFT_PREFIX) + ".weight"
        pairs.setdefault(name, {})[match.group(2)] = value
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].ndim != 2:
            raise UserError(f"the adapter's {name} is not a pair of 2-D A and B matrices; save it "
                            "with peft again")
    return {name: (pair["A"], pair["B"]) for name, pair in pairs.items()}


def _module(key: str) -> str:
    return key.removeprefix(_PEFT_PREFIX).split(".lora_")[0]


def peft_scale(settings: dict, module: str, rank: int) -> float:
    """peft's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA; alpha from
    ``alpha_pattern`` where a key matches the module's name (peft ``utils/other.py``,
    ``get_pattern_key``: the key as the name's whole last dotted part(s), as a regex)."""
    alpha = settings.get("lora_alpha") or 0.0
    for key, value in (settings.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def llama_cpp_lora(state: dict[str, np.ndarray], settings: dict, model_type: str, config: dict,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{GGUF weight name: (A, B)}`` as llama.cpp applies them to our converted base: B's rows
    reordered as the weight's, peft's scaling beyond ``alpha / r`` folded into B, each pair checked
    against the base's tensor ``shapes`` (a target the base lacks, such as a tied head, is refused).
    """
    namer, reorder = gguf_namer(model_type, config), row_reordering(model_type, config)
    alpha = settings.get("lora_alpha") or 0.0
    tensors = {}
    for hf_name, (a, b) in lora_pairs(state).items():
        module = hf_name.removesuffix(".weight")
        name = namer(hf_name)
        if name is None:
            raise UserError(f"the adapter adapts {module}, which has no tensor in llama.cpp's "
                            f"{model_type} graph; pass the base it was trained on")
        if name == "token_embd.weight":
            raise UserError(f"the adapter adapts the token embedding ({module}); llama.cpp "
                            "applies LoRA to matrix products only")
        if name not in shapes:
            tied = " (the head is tied to the embeddings)" if name == "output.weight" else ""
            raise UserError(f"the adapter adapts {module}, which the base has no separate weight "
                            f"for{tied}; llama.cpp cannot apply it: train without it in "
                            "target_modules")
        if shapes[name] != (b.shape[0], a.shape[1]):
            raise UserError(f"the adapter's {module} is {b.shape[0]}x{a.shape[1]}, the base's is "
                            f"{'x'.join(map(str, shapes[name]))}; pass the base it was trained on")
        rank = a.shape[0]
        llama_scale = alpha / rank if alpha else 1.0
        factor = peft_scale(settings, module, rank) / llama_scale
        b = reorder(hf_name, b)
        tensors[name] = (a, b if factor == 1.0 else b * np.float32(factor))
    if not tensors:
        raise UserError("the adapter holds no LoRA matrices; pass "
                        "the adapter directory of a finished run")
    return tensors
