"""Where and how the training stages compute: the device, the forward precision, gradient
checkpointing and 4-bit base weights, from the recipe's ``[compute]`` section.

One resolver turns ``compute.device`` (auto, cpu, cuda, cuda:N, mps) into a torch device: auto is
the CUDA GPU when there is one, else Apple's GPU (MPS), else the CPU; a device that is not there is
one line and exit code 2. Precision only changes the forward passes (autocast); the envelope's own
math stays float32 whatever it is. The Trainer stages (SFT, reward model) can also take a DeepSpeed
config (``compute.deepspeed``: the bundled ZeRO-2 or a file); the launch files shipped with the
package are in ``LAUNCH_DIR``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slm_align.config import ComputeSettings
from slm_align.errors import UserError

AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""The torch dtype name of each reduced precision (fp32 runs without autocast)."""
LAUNCH_DIR = Path(__file__).parents[1] / "assets" / "launch"
"""The launch files shipped with the package: accelerate configs (one machine, several)
and DeepSpeed's ZeRO-2."""
DEEPSPEED_PRESETS = {"zero2": LAUNCH_DIR / "deepspeed_zero2.json"}
"""``--deepspeed NAME``: the bundled DeepSpeed configs (batch sizes, clipping and precision
"auto": the Trainer fills them in from the recipe; no optimizer or scheduler: the Trainer's
AdamW and cosine schedule)."""


def mps_available() -> bool:
    """Whether this torch can use Apple's GPU (MPS)."""
    import torch

    backend = getattr(torch.backends, "mps", None)
    return backend is not None and backend.is_available()


def auto_device() -> str:
    """The accelerator there is: the first CUDA GPU, else MPS, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return "cuda:0"
    if mps_available():
        return "mps"
    return "cpu"


def _cuda_device(spec: str) -> str:
    """``cuda`` or ``cuda:N`` as an existing CUDA device, or one line naming
    what this machine has."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"--device {spec}: no CUDA GPU here (torch {torch.__version__}, CUDA "
                        f"build: {torch.version.cuda or 'no'}); pass --device cpu or --device auto")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise UserError(f"--device {spec}: this machine has {count} CUDA GPU(s), cuda:0 to "
                        f"cuda:{count - 1}; pass one of those")
    return f"cuda:{index}"


def resolve_device(spec: str = "auto") -> str:
    """The torch device of ``spec`` (auto, cpu, cuda, cuda:N, mps): "cpu", "mps" or "cuda:N"."""
    if spec == "auto":
        return auto_device()
    if spec == "cpu":
        return "cpu"
    if spec == "mps":
        if not mps_available():
            raise UserError("--device mps: no Apple GPU (MPS) here; pass "
                            "--device cpu or --device auto")
        return "mps"
    return _cuda_device(spec)


def device_of(model):
    """The torch device a model computes on: that of its first parameter."""
    return next(model.parameters()).device


def forward_autocast(device, precision: str):
    """The context of a forward pass: autocast to bf16/fp16 on ``device``, nothing at fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=torch.device(device).type,
                          dtype=getattr(torch, AUTOCAST_DTYPES[precision]))


def _check_precision(device: str, precision: str) -> None:
    """fp16 needs CUDA (loss scaling); bf16 on CUDA needs a GPU that has it."""
    import torch

    if precision == "fp16" and not device.startswith("cuda"):
        raise UserError("--precision fp16 needs a CUDA GPU (loss scaling); on "
                        f"{device} use bf16 or fp32")
    if precision == "bf16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16: {torch.cuda.get_device_name(device)} "
                        "has no bfloat16; use fp16")


def deepspeed_file(spec: str) -> Path:
    """The DeepSpeed config ``spec`` names: a bundled one (zero2) or a JSON
    file holding an object."""
    if spec in DEEPSPEED_PRESETS:
        return DEEPSPEED_PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--deepspeed {spec}: no such file; pass zero2 (the bundled ZeRO-2 config) "
                        "or a DeepSpeed JSON config file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"--deepspeed {spec}: not a JSON file ({exc}); pass "
                        "a DeepSpeed JSON config") from None
    if not isinstance(config, dict):
        raise UserError(f"--deepspeed {spec}: a DeepSpeed config is a JSON object, not a "
                        f"{type(config).__name__}")
    return path


def _deepspeed_config(spec: str, device: str, trainer: bool) -> str:
    """The DeepSpeed config file of a Trainer stage; refused by the envelope's own loops (RL, DPO,
    KTO), without the deepspeed package and off CUDA."""
    if not trainer:
        raise UserError("--deepspeed applies to the Trainer stages (sft, train --stage "
                        "sft|reward); RL, DPO and KTO run the envelope's own guarded loop: "
                        "drop it for this stage")
    path = deepspeed_file(spec)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UserError("--deepspeed needs DeepSpeed: pip install deepspeed") from None
    if not device.startswith("cuda"):
        raise UserError("--deepspeed: DeepSpeed's ZeRO shards training state across CUDA GPUs, "
                        f"not {device}; drop --deepspeed or pass --device cuda on a machine with "
                        "GPUs")
    return str(path)


def _check_4bit(device: str) -> None:
    """4-bit base weights (bitsandbytes) exist on CUDA only, and need bitsandbytes installed."""
    if not device.startswith("cuda"):
        raise UserError("--load-in-4bit: 4-bit base weights (bitsandbytes) need a CUDA GPU, not "
                        f"{device}; drop --load-in-4bit or pass --device cuda on a machine with "
                        "one")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("--load-in-4bit needs bitsandbytes: pip install bitsandbytes") from None


@dataclass(frozen=True)
class Compute:
    """A stage's resolved compute settings: the torch device and how forward passes run on it."""

    device: str
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    load_in_4bit: bool = False
    deepspeed: Optional[str] = None
    """The DeepSpeed config file the Trainer stages pass to
    TrainingArguments (None: no DeepSpeed)."""

    def autocast(self):
        """The context of this stage's forward passes (see :func:`forward_autocast`)."""
        return forward_autocast(self.device, self.precision)

    def trainer_arguments(self) -> dict:
        """TrainingArguments for this device: the CPU only when asked, mixed precision,
        checkpointing, DeepSpeed."""
        arguments = {"use_cpu": self.device == "cpu", "bf16": self.precision == "bf16",
                     "fp16": self.precision == "fp16",
                     "gradient_checkpointing": self.gradient_checkpointing}
        if self.gradient_checkpointing:
            arguments["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        if self.deepspeed is not None:
            arguments["deepspeed"] = self.deepspeed
        return arguments

    def quantization_config(self):
        """bitsandbytes' NF4 config of 4-bit base weights (bf16 compute), or
        None when they are off."""
        if not self.load_in_4bit:
            return None
        import torch
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)

    def record(self) -> dict:
        """What the manifest records: the device, the precision, the memory savers
        and the DeepSpeed config."""
        return {"device": self.device, "precision": self.precision,
                "gradient_checkpointing": self.gradient_checkpointing,
                "load_in_4bit": self.load_in_4bit, "deepspeed": self.deepspeed}


def resolve_compute(settings: ComputeSettings, quantizable: bool = False,
                    trainer: bool = True) -> Compute:
    """The stage's :class:`Compute`: the device resolved, the precision, 4-bit weights and DeepSpeed
    checked against it. ``quantizable``: the stage can train on 4-bit base weights (SFT); elsewhere
    they are refused. ``trainer``: the stage trains on transformers' Trainer (SFT, reward), which
    scales fp16 losses and takes DeepSpeed; the envelope's guarded step (RL, DPO, KTO) has neither,
    so those refuse fp16 and --deepspeed."""
    device = resolve_device(settings.device)
    _check_precision(device, settings.precision)
    if settings.precision == "fp16" and not trainer:
        raise UserError("--precision fp16: RL, DPO and KTO take the envelope's guarded step "
                        "without loss scaling; use bf16 or fp32")
    if settings.load_in_4bit:
        if not quantizable:
            raise UserError("--load-in-4bit applies to SFT only (QLoRA): the reward model is "
                            "published as a merged full-precision classifier, and RL, DPO and KTO "
                            "train on the merged full-precision SFT weights; "
                            "drop it for this stage")
        _check_4bit(device)
    deepspeed = None
    if settings.deepspeed is not None:
        deepspeed = _deepspeed_config(settings.deepspeed, device, trainer)
    return Compute(device, settings.precision, settings.gradient_checkpointing,
                   settings.load_in_4bit, deepspeed)


def check_trainer_device(compute: Compute) -> None:
    """Transformers' Trainer (SFT, reward) computes on the first visible GPU: refuse
    another index in one line."""
    if compute.device.startswith("cuda:") and compute.device != "cuda:0":
        index = compute.device.partition(":")[2]
        raise UserError(f"--device {compute.device}: SFT and the reward model train on the first "
                        f"visible GPU; run with CUDA_VISIBLE_DEVICES={index} and --device cuda")


def training_inputs(settings: ComputeSettings) -> dict:
    """The compute settings that change what a stage trains, for its inputs record: the precision
    and 4-bit weights when they are not the default (runs recorded before keep their hashes). The
    device does not change it."""
    given = {}
    if settings.precision != "fp32":
        given["precision"] = settings.precision
    if settings.load_in_4bit:
        given["load_in_4bit"] = True
    return given
