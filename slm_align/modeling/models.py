"""Load the policy and its tokenizer from any source; the tiny-model factory used by tests.

Sources: a local HF directory (safetensors), a hub id, or a local ``.gguf`` file (weights
dequantized by transformers' GGUF support, tokenizer rebuilt from the file's own metadata by
:mod:`slm_align.ondevice.gguf.tokenizer`). ``None`` means the bundled default model.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator, Optional

from slm_align.config import LoraSettings
from slm_align.config.hub_ids import looks_like_hub_id
from slm_align.errors import UserError

DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "assets" / "default-model"

# Attention projections adapted by LoRA, per architecture (model_type in config.json).
LORA_TARGETS: dict[str, list[str]] = {
    "gpt_neox": ["query_key_value", "dense"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gpt2": ["c_attn", "c_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma3_text": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
SUPPORTED_ARCHITECTURES = tuple(LORA_TARGETS)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is "dir", "hub" or "gguf"; ``ref`` the path or hub id."""

    kind: str
    ref: str

    @property
    def label(self) -> str:
        return "bundled default model" if Path(self.ref) == DEFAULT_MODEL_DIR else self.ref

    def pretrained_args(self) -> tuple[str, dict]:
        """Positional name and keyword arguments for ``from_pretrained``."""
        if self.kind == "gguf":
            path = Path(self.ref)
            return str(path.parent), {"gguf_file": path.name}
        return self.ref, {}


def model_record(source: ModelSource) -> dict:
    """The model as a stage's manifest records it: the bundled model without its path (so that a run
    copied to another machine, where the package lies elsewhere, is still recognised), any other by
    kind and path or hub id. ``resolve_source(record["ref"])`` gives the source back."""
    if source.kind == "dir" and Path(source.ref) == DEFAULT_MODEL_DIR:
        return {"kind": "bundled", "ref": None}
    return {"kind": source.kind, "ref": source.ref}


def resolve_source(spec: Optional[str]) -> ModelSource:
    """Classify ``--model``: an existing directory, an existing .gguf file, or a hub id."""
    if spec is None or spec == "":
        return ModelSource("dir", str(DEFAULT_MODEL_DIR))
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSource("dir", str(path.resolve()))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model {spec} is a file but not .gguf; "
                            "pass an HF model directory, a .gguf file or a hub id")
        return ModelSource("gguf", str(path.resolve()))
    if not looks_like_hub_id(spec) or spec.endswith(".gguf"):
        raise UserError(f"model {spec} not found; pass an HF model directory, a .gguf file "
                        "or a hub id (org/name)")
    return ModelSource("hub", spec)


def _check_directory(path: Path, allow_pickle: bool) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise UserError(f"model directory {path} has no config.json; pass a directory "
                        "saved by save_pretrained")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{config} is not valid JSON; the checkpoint is corrupt") from None
    check_architecture(model_type, str(path))
    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    if not has_safetensors and has_pickle and not allow_pickle:
        raise UserError(f"model {path} has only pickle (.bin) weights, which can run code when "
                        "loaded; convert it to safetensors or pass --allow-pickle if you trust it")
    if not has_safetensors and not has_pickle:
        raise UserError(f"model directory {path} has no weights (*.safetensors); "
                        "pass a complete checkpoint")
    for weights in sorted(path.glob("*.safetensors")):
        _check_not_truncated(weights)


def _check_not_truncated(weights: Path) -> None:
    """A safetensors file shorter than its own header says is cut off (an
    interrupted copy or download)."""
    import struct

    try:
        with weights.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length)) if length < 100_000_000 else {}
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError):
        return  # not a readable header: the loader refuses it with its own message
    size = weights.stat().st_size
    expected = 8 + length + end
    if size < expected:
        raise UserError(f"model {weights} is truncated ({size} of {expected} bytes) and cannot be "
                        "loaded; copy or download the checkpoint again")


def check_architecture(model_type: Optional[str], where: str) -> str:
    if model_type not in LORA_TARGETS:
        raise UserError(f"model {where}: unsupported architecture '{model_type}'; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return model_type


def _hub_error(source: ModelSource, exc: Exception) -> UserError:
    return UserError(f"cannot load '{source.ref}' from the Hugging Face Hub "
                     f"({type(exc).__name__}); check the id and your connection, or pass a local "
                     "directory or .gguf file")


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    """The source's tokenizer, with a pad token guaranteed (see :func:`ensure_pad_token`).

    A .gguf file's tokenizer is rebuilt from its own ``tokenizer.*`` metadata and checked against
    llama.cpp (:mod:`slm_align.ondevice.gguf.tokenizer`; transformers' GGUF tokenizer conversion is
    lossy) on first use, then read from the file's cached HF directory (:func:`gguf_directory`).
    """
    from transformers import AutoTokenizer

    if source.kind == "gguf":
        source = gguf_directory(source)
    if source.kind == "dir":
        _check_directory(Path(source.ref), allow_pickle=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.ref, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, or hub errors
        if source.kind == "hub":
            raise _hub_error(source, exc) from None
        raise UserError(f"model {source.label}: cannot load its tokenizer ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]}); the "
                        "directory needs tokenizer files") from None
    if source.kind == "dir":
        _check_vocabulary(tokenizer, Path(source.ref))
    return ensure_pad_token(tokenizer)


def tokenizer_sidecar(source: ModelSource) -> Path | None:
    """Where the source's GGUF tokenizer fields are: the .gguf itself, a saved model's
    ``tokenizer.gguf``, or None."""
    from slm_align.ondevice.gguf.tokenizer import SIDECAR

    if source.kind == "gguf":
        return Path(source.ref)
    sidecar = Path(source.ref) / SIDECAR
    return sidecar if source.kind == "dir" and sidecar.is_file() else None


def save_tokenizer(tokenizer, source: ModelSource, directory: Path) -> None:
    """Save ``tokenizer`` into a model directory; when the model came from a GGUF file, its
    ``tokenizer.*`` fields go too (``tokenizer.gguf``), so that GGUF export writes the
    source's exact tokenizer back."""
    from slm_align.ondevice.gguf.tokenizer import write_sidecar

    tokenizer.save_pretrained(directory)
    origin = tokenizer_sidecar(source)
    if origin is not None:
        write_sidecar(origin, Path(directory))


def _check_vocabulary(tokenizer, path: Path) -> None:
    """Token ids past the model's embedding rows would crash the first forward pass;
    refuse the pair up front."""
    rows = json.loads((path / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise UserError(f"model {path}: its tokenizer has {len(tokenizer)} tokens but the model's "
                        f"vocab_size is {rows} (embedding rows); save the tokenizer the model was "
                        f"trained with beside its weights")


def ensure_pad_token(tokenizer):
    """Give a tokenizer without a pad token one, without changing the vocabulary.

    The EOS token doubles as padding; losses mask by attention, never by pad id,
    so a real EOS still trains.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError("the tokenizer has neither a pad nor an EOS token; add one to "
                            "tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


# Config fields that transformers' GGUF loader (4.57) leaves at their defaults although the file has
# them, as {model_type: {GGUF key after "<arch>.": config field}}. Gemma 3: llama.cpp scales
# attention by 1/sqrt(head_dim), so query_pre_attn_scalar is the key length (transformers' default,
# 256, fits only head_dim 256).
_GGUF_CONFIG_GAPS = {
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma3_text": {"attention.key_length": "query_pre_attn_scalar",
                    "rope.freq_base_swa": "rope_local_base_freq",
                    "final_logit_softcapping": "final_logit_softcapping"},
    "gpt2": {"context_length": "n_positions", "feed_forward_length": "n_inner"},
}


def gguf_config(path: Path):
    """transformers' config of a .gguf file, with the fields its GGUF loader
    misses read from the file."""
    from transformers import AutoConfig

    from slm_align.ondevice.gguf.fields import read_fields

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    check_architecture(config.model_type, str(path))
    # the header only: gguf-py's reader parses every tensor (30 s on Gemma)
    fields = read_fields(path, prefix="")
    architecture = fields["general.architecture"].value
    for key, attribute in _GGUF_CONFIG_GAPS.get(config.model_type, {}).items():
        field = fields.get(f"{architecture}.{key}")
        if field is not None:
            setattr(config, attribute, field.value)
    return config


def load_model(source: ModelSource, trust_remote_code: bool = False, allow_pickle: bool = False,
               quantization=None):
    """The causal LM of a source, in float32, in eval mode (a .gguf file through its cached HF
    directory); ``quantization``: a transformers quantization config (4-bit base weights for
    QLoRA), None for float32."""
    if source.kind == "gguf":
        return _load_pretrained(gguf_directory(source), quantization=quantization)
    return _load_pretrained(source, trust_remote_code, allow_pickle, quantization)


def gguf_directory(source: ModelSource) -> ModelSource:
    """The HF directory of a .gguf source, dequantized and saved on first use
    (:mod:`slm_align.ondevice.gguf.cache`)."""
    from slm_align.ondevice.gguf import cache as gguf_cache

    path = Path(source.ref)

    def read_model():
        return _load_pretrained(source)

    def read_tokenizer():
        from slm_align.ondevice.gguf.tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)

    def write_tokenizer(tokenizer, directory: Path) -> None:
        save_tokenizer(tokenizer, source, directory)

    return ModelSource("dir", str(gguf_cache.materialize(path, read_model, read_tokenizer,
                                                         write_tokenizer)))


@contextmanager
def _gguf_bar_off() -> Iterator[None]:
    """transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF
    tensors...") whatever ``hf_logging.disable_progress_bar()`` says (it calls tqdm without
    ``disable``), which a log gets as carriage-return lines. For the call, the loader's ``tqdm`` is
    tqdm with ``disable=True``: the stage that loads the model shows its own progress
    (:mod:`slm_align.progress`)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loading

    drawn = gguf_loading.tqdm
    gguf_loading.tqdm = partial(drawn, disable=True)
    try:
        yield
    finally:
        gguf_loading.tqdm = drawn


def _load_pretrained(source: ModelSource, trust_remote_code: bool = False,
                     allow_pickle: bool = False, quantization=None):
    """``from_pretrained`` of a directory, hub id or .gguf file, with one-line errors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # long stages show their own progress (and _gguf_bar_off)
    name, kwargs = source.pretrained_args()
    if source.kind == "dir":
        _check_directory(Path(source.ref), allow_pickle)
    try:
        if source.kind == "hub":
            config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
            check_architecture(config.model_type, source.ref)
        if source.kind == "gguf":
            kwargs["config"] = gguf_config(Path(source.ref))
        if quantization is not None:
            kwargs["quantization_config"] = quantization
        with _gguf_bar_off():
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=torch.float32, trust_remote_code=trust_remote_code,
                use_safetensors=None if (allow_pickle or source.kind == "gguf") else True, **kwargs)
    except UserError:
        raise
    except Exception as exc:
        if source.kind == "hub":
            raise _hub_error(source, exc) from None
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UserError(f"model {source.label} cannot be loaded ({first}); the checkpoint may be "
                        "corrupt or of an unsupported architecture") from None
    check_architecture(model.config.model_type, source.label)
    if quantization is not None:
        return model.eval()  # 4-bit weights stay 4-bit (.float() would refuse them)
    return model.float().eval()


def lora_targets(model_type: str, override: Optional[list[str]] = None) -> list[str]:
    """Module names LoRA adapts: the override when given, else the architecture's
    attention projections."""
    return list(override) if override else list(LORA_TARGETS[check_architecture(model_type, model_type)])


def _llama_like(hidden: int, layers: int) -> dict:
    """Llama and Qwen2: grouped-query attention, head_dim = hidden / heads."""
    return {"hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _qwen3(hidden: int, layers: int) -> dict:
    """Qwen3: q/k norms and an explicit head_dim that is not hidden / heads."""
    return {**_llama_like(hidden, layers), "head_dim": hidden // 2}


def _gemma3_text(hidden: int, layers: int) -> dict:
    """Gemma 3 (text): at least six layers, because llama.cpp makes every sixth layer global (the
    first at index 5) and the rest sliding; a sliding window of 8 tokens, so that it matters on any
    longer probe."""
    head_dim = hidden // 2
    return {"hidden_size": hidden, "intermediate_size": hidden * 2,
            "num_hidden_layers": max(layers, 6), "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": head_dim, "query_pre_attn_scalar": head_dim, "sliding_window": 8,
            "max_position_embeddings": 512}


def _gpt_neox(hidden: int, layers: int) -> dict:
    return {"hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
            "num_attention_heads": 4, "max_position_embeddings": 512}


def _gpt2(hidden: int, layers: int) -> dict:
    return {"n_embd": hidden, "n_layer": layers, "n_head": 4, "n_positions": 512}


# config.json fields of each architecture's tiny model (besides vocab_size), from
# hidden width and layer count.
_TINY_CONFIGS = {"llama": _llama_like, "qwen2": _llama_like, "qwen3": _qwen3,
                 "gemma3_text": _gemma3_text, "gpt_neox": _gpt_neox, "gpt2": _gpt2}


def build_tiny_model(architecture: str, vocab_size: int, seed: int = 0, hidden: int = 32,
                     layers: int = 2):
    """A randomly initialised model of ``architecture`` with a few layers,
    for tests and benchmarks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    check_architecture(architecture, architecture)
    config = AutoConfig.for_model(architecture, vocab_size=vocab_size,
                                  **_TINY_CONFIGS[architecture](hidden, layers))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float().eval()


def load_adapter(model, adapter_dir: Path, allow_pickle: bool = False):
    """Attach a saved peft adapter to ``model`` (the adapter stays switchable; frozen, in float32,
    eval mode). Every adapter the package loads comes through here: one saved only as pickle needs
    ``allow_pickle`` (:func:`require_adapter`)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    require_adapter(adapter_dir, allow_pickle)
    try:
        return PeftModel.from_pretrained(model, str(adapter_dir)).float().eval()
    except Exception as exc:
        raise UserError(f"adapter {adapter_dir} does not fit this base model "
                        f"({type(exc).__name__}); pass the base model the adapter was trained "
                        "on") from None


def require_adapter(adapter_dir: Path, allow_pickle: bool) -> None:
    """Refuse, before any loading, an adapter directory without ``adapter_config.json`` or one saved
    only as pickle (``adapter_model.bin``, which peft reads with ``torch.load`` and which can run
    code) unless ``allow_pickle``."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(f"adapter {adapter_dir} not found (no adapter_config.json); pass the "
                        "sft/adapter directory of a finished run")
    safe = (adapter_dir / "adapter_model.safetensors").is_file()
    pickle_only = (adapter_dir / "adapter_model.bin").is_file() and not safe
    if pickle_only and not allow_pickle:
        raise UserError(f"adapter {adapter_dir} is saved only as pickle (adapter_model.bin), which "
                        "can run code when loaded; convert it to safetensors or pass "
                        "--allow-pickle if you trust it")


def merged_policy(source: ModelSource, adapter: Optional[Path], trust_remote_code: bool = False,
                  allow_pickle: bool = False):
    """The policy's weights with the SFT adapter folded in (a plain model, no peft wrapper)."""
    model = load_model(source, trust_remote_code, allow_pickle)
    return load_adapter(model, adapter, allow_pickle).merge_and_unload() if adapter is not None else model


def attach_lora(model, lora: LoraSettings, seed: int, task_type: str = "CAUSAL_LM"):
    """Wrap ``model`` with a fresh LoRA adapter (for SEQ_CLS, peft also trains the score head)."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    set_seed(seed)
    targets = lora_targets(model.config.model_type, lora.target_modules)
    try:
        return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                                lora_dropout=lora.dropout, target_modules=targets,
                                                task_type=task_type))
    except ValueError as exc:
        raise UserError(f"LoRA target modules {targets} do not match this model ({exc}); "
                        "name existing modules with --lora-targets") from None


def save_adapter(model, path: Path) -> None:
    """Save a peft adapter as safetensors (the base model is not saved)."""
    with warnings.catch_warnings():
        # peft warns when the base came from a .gguf or the bundled dir: harmless
        warnings.filterwarnings("ignore", message="Could not find a config file")
        model.save_pretrained(path, safe_serialization=True)
