"""Where and how the training stages compute: the device, the forward precision, gradient checkpointing and 4-bit
base weights, from the recipe's ``[compute]`` section.

One resolver turns ``compute.device`` (auto, cpu, cuda, cuda:N, mps) into a torch device: auto is the CUDA GPU when
there is one, else Apple's GPU (MPS), else the CPU; a device that is not there is one line and exit code 2.
Precision only changes the forward passes (autocast); the envelope's own math stays float32 whatever it is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from slm_align.config import ComputeSettings
from slm_align.errors import UserError

AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""The torch dtype name of each reduced precision (fp32 runs without autocast)."""


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
    """``cuda`` or ``cuda:N`` as an existing CUDA device, or one line naming what this machine has."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"--device {spec}: no CUDA GPU here (torch {torch.__version__}, "
                        f"CUDA build: {torch.version.cuda or 'no'}); pass --device cpu or --device auto")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise UserError(f"--device {spec}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}; "
                        "pass one of those")
    return f"cuda:{index}"


def resolve_device(spec: str = "auto") -> str:
    """The torch device of ``spec`` (auto, cpu, cuda, cuda:N, mps): "cpu", "mps" or "cuda:N"."""
    if spec == "auto":
        return auto_device()
    if spec == "cpu":
        return "cpu"
    if spec == "mps":
        if not mps_available():
            raise UserError("--device mps: no Apple GPU (MPS) here; pass --device cpu or --device auto")
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

    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, AUTOCAST_DTYPES[precision]))


def _check_precision(device: str, precision: str) -> None:
    """fp16 needs CUDA (loss scaling); bf16 on CUDA needs a GPU that has it."""
    import torch

    if precision == "fp16" and not device.startswith("cuda"):
        raise UserError(f"--precision fp16 needs a CUDA GPU (loss scaling); on {device} use bf16 or fp32")
    if precision == "bf16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16; use fp16")


def _check_4bit(device: str) -> None:
    """4-bit base weights (bitsandbytes) exist on CUDA only, and need bitsandbytes installed."""
    if not device.startswith("cuda"):
        raise UserError(f"--load-in-4bit: 4-bit base weights (bitsandbytes) need a CUDA GPU, not {device}; "
                        "drop --load-in-4bit or pass --device cuda on a machine with one")
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

    def autocast(self):
        """The context of this stage's forward passes (see :func:`forward_autocast`)."""
        return forward_autocast(self.device, self.precision)

    def trainer_arguments(self) -> dict:
        """TrainingArguments for this device: the CPU only when asked, mixed precision and checkpointing."""
        arguments = {"use_cpu": self.device == "cpu", "bf16": self.precision == "bf16",
                     "fp16": self.precision == "fp16", "gradient_checkpointing": self.gradient_checkpointing}
        if self.gradient_checkpointing:
            arguments["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        return arguments

    def quantization_config(self):
        """bitsandbytes' NF4 config of 4-bit base weights (bf16 compute), or None when they are off."""
        if not self.load_in_4bit:
            return None
        import torch
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)

    def record(self) -> dict:
        """What the manifest records: the device and the precision."""
        return {"device": self.device, "precision": self.precision,
                "gradient_checkpointing": self.gradient_checkpointing, "load_in_4bit": self.load_in_4bit}


def resolve_compute(settings: ComputeSettings, quantizable: bool = False, loss_scaling: bool = True) -> Compute:
    """The stage's :class:`Compute`: the device resolved, the precision and 4-bit weights checked against it.
    ``quantizable``: the stage can train on 4-bit base weights (SFT); elsewhere they are refused. ``loss_scaling``:
    the stage scales fp16 losses (the Trainer does; the envelope's guarded step does not, so RL, DPO and KTO refuse
    fp16)."""
    device = resolve_device(settings.device)
    _check_precision(device, settings.precision)
    if settings.precision == "fp16" and not loss_scaling:
        raise UserError("--precision fp16: RL, DPO and KTO take the envelope's guarded step without loss scaling; "
                        "use bf16 or fp32")
    if settings.load_in_4bit:
        if not quantizable:
            raise UserError("--load-in-4bit applies to SFT only (QLoRA); the reward model, RL, DPO and KTO train "
                            "on full-precision weights: drop it for this stage")
        _check_4bit(device)
    return Compute(device, settings.precision, settings.gradient_checkpointing, settings.load_in_4bit)


def check_trainer_device(compute: Compute) -> None:
    """Transformers' Trainer (SFT, reward) computes on the first visible GPU: refuse another index in one line."""
    if compute.device.startswith("cuda:") and compute.device != "cuda:0":
        index = compute.device.partition(":")[2]
        raise UserError(f"--device {compute.device}: SFT and the reward model train on the first visible GPU; run "
                        f"with CUDA_VISIBLE_DEVICES={index} and --device cuda")


def training_inputs(settings: ComputeSettings) -> dict:
    """The compute settings that change what a stage trains, for its inputs record: the precision and 4-bit weights
    when they are not the default (runs recorded before keep their hashes). The device does not change it."""
    given = {}
    if settings.precision != "fp32":
        given["precision"] = settings.precision
    if settings.load_in_4bit:
        given["load_in_4bit"] = True
    return given
