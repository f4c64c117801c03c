"""What the estimator needs to know about a model, read from its files without loading it.

Three inputs: an HF directory (config.json + *.safetensors; parameters counted from the safetensors
headers, which are an 8-byte little-endian length followed by JSON), a ``.gguf`` file (metadata and
tensor table through ``gguf.GGUFReader``, imported lazily) and an ONNX export directory (config.json
next to model.onnx; the parameter count is derived from config.json because counting initializers
would need the onnx package).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from slm_align.errors import UserError
from slm_align.ondevice.devices.quant import BITS_PER_WEIGHT, find_quant

SAFETENSORS_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32,
                          "I16": 16, "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8}


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of one model artifact."""

    # the path the facts were read from (or a reference point's name)
    source: str
    format: str                              # hf, gguf, onnx or reference
    parameters: int                          # parameter count
    architecture: Optional[str] = None       # model_type / general.architecture
    layers: Optional[int] = None             # transformer blocks
    hidden_size: Optional[int] = None        # embedding width
    attention_heads: Optional[int] = None    # query heads
    kv_heads: Optional[int] = None           # key/value heads (GQA)
    head_dim: Optional[int] = None           # dimension of one head
    vocab_size: Optional[int] = None         # tokenizer vocabulary (rows of the embedding)
    context_length: Optional[int] = None     # longest context the model was trained for
    # weight type of the artifact (F32, F16, Q4_K_M, int8, ...)
    quant: Optional[str] = None
    weight_bytes: Optional[int] = None       # bytes of the weights in the artifact, when known
    parameters_exact: bool = True            # False when the count is derived from config.json

    @property
    def bits_per_weight(self) -> Optional[float]:
        """Bits per weight of the artifact itself, when its size is known."""
        return None if self.weight_bytes is None else self.weight_bytes * 8 / self.parameters

    @property
    def kv_bytes_per_token(self) -> Optional[int]:
        """f16 KV-cache bytes per token of context: 2 (K and V) x layers x
        kv_heads x head_dim x 2 bytes."""
        if None in (self.layers, self.kv_heads, self.head_dim):
            return None
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def to_dict(self) -> dict:
        return dict(asdict(self), bits_per_weight=self.bits_per_weight,
                    kv_bytes_per_token=self.kv_bytes_per_token)


def _first(config: dict, *keys: str) -> Any:
    return next((config[key] for key in keys if config.get(key) is not None), None)


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{directory}: no config.json; pass an HF model directory, an ONNX export "
                        "directory or a .gguf file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); re-save the "
                        "model with save_pretrained") from None


def _dims_from_config(config: dict) -> dict:
    """Layers, widths and heads under the names the common architectures use."""
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    kv_heads = _first(config, "num_key_value_heads", "n_head_kv") or heads
    head_dim = _first(config, "head_dim") or (hidden // heads if hidden and heads else None)
    return dict(architecture=config.get("model_type"),
                layers=_first(config, "num_hidden_layers", "n_layer"), hidden_size=hidden,
                attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                vocab_size=_first(config, "vocab_size"),
                context_length=_first(config, "max_position_embeddings", "n_positions",
                                      "max_sequence_length"))


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> dtype, shape, data_offsets."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError("header length out of range")
            header = json.loads(handle.read(length))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a safetensors file ({exc}); re-save the "
                        "model with save_pretrained") from None
    header.pop("__metadata__", None)
    expected = 8 + length + max((t.get("data_offsets", (0, 0))[1] for t in header.values()),
                                default=0)
    if path.stat().st_size < expected:
        raise UserError(f"{path}: truncated safetensors file ({path.stat().st_size} of {expected} "
                        "bytes); copy or download the model again")
    return header


def _dominant(bytes_by_type: dict[str, int]) -> Optional[str]:
    return max(bytes_by_type, key=bytes_by_type.get) if bytes_by_type else None


def hf_facts(directory: Path) -> ModelFacts:
    """Facts of an HF directory: parameters and bytes from the safetensors headers,
    dimensions from config.json."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory}: no *.safetensors weights; save the model with "
                        "save_pretrained (safe_serialization=True)")
    config = _read_config(directory)
    parameters = 0
    bytes_by_type = {}
    for file in files:
        for tensor in safetensors_header(file).values():
            start, end = tensor["data_offsets"]
            parameters += math.prod(tensor["shape"])
            bytes_by_type[tensor["dtype"]] = bytes_by_type.get(tensor["dtype"], 0) + end - start
    return ModelFacts(source=str(directory), format="hf", parameters=parameters,
                      **_dims_from_config(config), quant=find_quant(_dominant(bytes_by_type) or ""),
                      weight_bytes=sum(bytes_by_type.values()))


def _gguf_value(reader, key: str) -> Any:
    """A metadata value: a number, a string, or a list of them."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    import gguf  # gguf-py before ReaderField.contents(): decode the parts by hand

    string = field.types[-1] == gguf.GGUFValueType.STRING
    values = [bytes(field.parts[i]).decode("utf-8") if string else field.parts[i].tolist()[0]
              for i in field.data]
    return values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]


def _gguf_quant(reader, bytes_by_type: dict[str, int]) -> Optional[str]:
    import gguf

    file_type = _gguf_value(reader, "general.file_type")
    if file_type is not None:
        try:
            name = gguf.LlamaFileType(int(file_type)).name
            found = find_quant(name.removeprefix("MOSTLY_").removeprefix("ALL_"))
            if found:
                return found
        except ValueError:
            pass
    return find_quant(_dominant(bytes_by_type) or "")


def gguf_facts(path: Path) -> ModelFacts:
    """Facts of a .gguf file: ``{arch}.*`` metadata and the tensor table
    (actual bytes per tensor)."""
    try:
        import gguf
    except ImportError:
        raise UserError("reading .gguf files needs the gguf package; pip install gguf") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, ... on a damaged file
        raise UserError(f"{path}: not a readable GGUF file "
                        f"({type(exc).__name__}: {exc}); re-export it") from None
    arch = _gguf_value(reader, "general.architecture")
    meta = {key: _gguf_value(reader, f"{arch}.{key}") for key in
            ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
             "attention.key_length", "context_length", "vocab_size")}
    bytes_by_type: dict[str, int] = {}
    for tensor in reader.tensors:
        bytes_by_type[tensor.tensor_type.name] = bytes_by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    heads = meta["attention.head_count"]
    hidden = meta["embedding_length"]
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
    return ModelFacts(
        source=str(path), format="gguf", architecture=arch,
        parameters=sum(int(tensor.n_elements) for tensor in reader.tensors),
        layers=meta["block_count"], hidden_size=hidden, attention_heads=heads,
        kv_heads=meta["attention.head_count_kv"] or heads,
        head_dim=meta["attention.key_length"] or (hidden // heads if hidden and heads else None),
        vocab_size=meta["vocab_size"] or (len(tokens) if tokens is not None else None),
        context_length=meta["context_length"], quant=_gguf_quant(reader, bytes_by_type),
        weight_bytes=sum(bytes_by_type.values()))


# Families by what a layer holds besides its attention and MLP matrices.
_UNGATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon"}  # two MLP matrices, not three
# a bias on every linear layer; LayerNorms with biases
_BIASED = {"gpt2", "gpt_neox"}
_LEARNED_POSITIONS = {"gpt2": "n_positions"}    # a position embedding table of this many rows
_QK_NORMS = {"qwen3", "gemma3_text"}            # an RMSNorm over each query and key head
_SANDWICH_NORMS = {"gemma3_text"}               # norms after attention and after the MLP too


def _layer_extras(model_type: Optional[str], hidden: int, intermediate: int, q_width: int,
                  kv_width: int, head_dim: int) -> int:
    """Norm weights and biases of one layer (the two pre-norms included)."""
    if model_type in _BIASED:
        return 2 * 2 * hidden + (q_width + 2 * kv_width + hidden) + (intermediate + hidden)
    extras = 2 * hidden
    if model_type == "qwen2":  # q/k/v biases
        extras += q_width + 2 * kv_width
    if model_type in _QK_NORMS:
        extras += 2 * head_dim
    if model_type in _SANDWICH_NORMS:
        extras += 2 * hidden
    return extras


def params_from_config(config: dict) -> int:
    """Parameter count of a decoder-only transformer from its config (embeddings, attention, MLP,
    norms, biases); exact for the architectures slm-align trains."""
    dims = _dims_from_config(config)
    hidden = dims["hidden_size"]
    layers = dims["layers"]
    vocab = dims["vocab_size"]
    if not (hidden and layers and vocab):
        raise UserError("config.json lacks hidden_size, num_hidden_layers or "
                        "vocab_size; cannot size the model")
    model_type = config.get("model_type")
    q_width = dims["attention_heads"] * dims["head_dim"]
    kv_width = dims["kv_heads"] * dims["head_dim"]
    intermediate = _first(config, "intermediate_size", "n_inner") or 4 * hidden
    attention = 2 * hidden * q_width + 2 * hidden * kv_width
    mlp = (2 if model_type in _UNGATED else 3) * hidden * intermediate
    layer = attention + mlp + _layer_extras(model_type, hidden, intermediate, q_width, kv_width,
                                            dims["head_dim"])
    untied = not config.get("tie_word_embeddings", True)
    embeddings = vocab * hidden * (2 if untied else 1)
    positions = config.get(_LEARNED_POSITIONS.get(model_type, ""), 0) * hidden
    final_norm = hidden * (2 if model_type in _BIASED else 1)
    return embeddings + positions + layers * layer + final_norm


def _onnx_quant(bits: float) -> str:
    """The ONNX weight type nearest to the measured bits per weight."""
    return min(("F32", "F16", "w8", "int8", "int4"), key=lambda q: abs(BITS_PER_WEIGHT[q] - bits))


def onnx_facts(directory: Path) -> ModelFacts:
    """Facts of an ONNX export directory: bytes of *.onnx plus external data;
    parameters from config.json."""
    files = [p for p in directory.iterdir() if p.is_file() and
             (p.suffix == ".onnx" or p.name.endswith((".onnx_data", ".onnx.data")))]
    config = _read_config(directory)
    parameters = params_from_config(config)
    weight_bytes = sum(p.stat().st_size for p in files)
    return ModelFacts(source=str(directory), format="onnx", parameters=parameters,
                      **_dims_from_config(config), quant=_onnx_quant(weight_bytes * 8 / parameters),
                      weight_bytes=weight_bytes, parameters_exact=False)


def model_facts(path) -> ModelFacts:
    """Facts of an HF directory, a .gguf file (or a directory holding exactly one) or an
    ONNX export directory."""
    path = Path(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1 and not any(path.glob("*.safetensors")):
        # an export directory holding one .gguf
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return gguf_facts(path)
    if path.is_dir() and any(path.glob("*.onnx")):
        return onnx_facts(path)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return hf_facts(path)
    if not path.exists():
        raise UserError(f"model {path} not found; pass an HF directory, a .gguf file or "
                        "an ONNX export directory")
    raise UserError(f"{path}: not a model this can size; pass an HF directory with *.safetensors, "
                    "a .gguf file or an ONNX export directory with model.onnx")
