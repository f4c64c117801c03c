"""Device profiles: TOML data files validated into :class:`DeviceProfile`.

The bundled profiles live next to this module in ``profiles/``. Users add or override profiles with
their own files in ``~/.config/slm-align/devices/`` and in the directory named by
``$SLM_ALIGN_DEVICES``; a file with the same name as a bundled one replaces it (later directories
win: bundled, then the config directory, then the environment variable).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slm_align.config.tomlcompat import tomllib
from slm_align.errors import UserError
from slm_align.ondevice.devices.quant import BITS_PER_WEIGHT, GGUF_TYPES, find_quant

BUNDLED_DIR = Path(__file__).parent / "profiles"
ENV_DIR = "SLM_ALIGN_DEVICES"
ISA_FEATURES = {"neon", "dotprod", "i8mm", "fp16", "bf16", "sve", "sve2", "sme",
                "sse4", "avx", "avx2", "avx512", "avx512_vnni", "avx_vnni", "amx"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReferencePoint(_Strict):
    """One published decode measurement on the device, with the model facts the estimator needs."""

    model: str = Field(description="Model name as published, e.g. 'Qwen2.5-0.5B-Instruct'.")
    parameters: int = Field(gt=0, description="Parameter count of the model.")
    quant: str = Field(description="Weight type of the measured artifact, e.g. "
                                   "Q4_K_M, Q8_0, F16, int8.")
    tokens_per_second: float = Field(gt=0,
                                     description="Measured decode (generation) speed in tokens/s.")
    context: int = Field(256, ge=1, description="Tokens in the KV cache during "
                                                "the measurement (about).")
    size_gb: Optional[float] = Field(None, gt=0, description="Size of the measured file in GB (1e9 "
                                                             "bytes), when published; otherwise "
                                                             "derived from the quant.")
    layers: Optional[int] = Field(None, ge=1,
                                  description="Transformer blocks (for the KV-cache term).")
    kv_heads: Optional[int] = Field(None, ge=1,
                                    description="Key/value heads (for the KV-cache term).")
    head_dim: Optional[int] = Field(None, ge=1, description="Dimension of one attention head "
                                                            "(KV-cache term).")
    runtime: str = Field("llama.cpp", description="What ran the measurement "
                                                  "(llama.cpp build, ollama, ...).")
    source: str = Field(min_length=3, description="Where the figure comes from: URL or citation, "
                                                  "and whether it is an approximation.")


class DeviceProfile(_Strict):
    """What the estimator knows about one device."""

    name: str = Field(description="Profile name: the TOML file's stem, e.g. 'rpi5'.")
    display_name: str = Field(description="Human-readable device name.")
    ram_gb: float = Field(gt=0, description="Installed RAM in GiB.")
    app_memory_share: float = Field(gt=0, le=1, description="Share of RAM one app may use before "
                                                            "the OS kills it or the system swaps.")
    cores: int = Field(ge=1, description="CPU cores.")
    threads: int = Field(ge=1, description="Threads to run inference with "
                                           "(often the big cores only).")
    isa: list[str] = Field(description="Instruction-set features the kernels can use (neon, "
                                       "dotprod, i8mm, avx2, avx512, avx512_vnni, ...).")
    bandwidth_gbs: float = Field(gt=0, description="Effective memory bandwidth "
                                                   "for CPU reads in GB/s.")
    bandwidth_source: str = Field(min_length=3,
                                  description="Where the bandwidth figure comes from.")
    runtime: Literal["gguf", "onnx"] = Field(description="Preferred runtime format on this device.")
    gguf_quant: str = Field(description="Preferred GGUF weight type (before any downgrade to fit).")
    onnx_preset: Literal["arm64", "avx2", "avx512", "avx512_vnni"] = Field(
        description="Preferred ONNX Runtime quantization preset (optimum's per-ISA presets).")
    ubatch: int = Field(512, ge=1, description="Prompt micro-batch the runtime is configured with "
                                               "(sizes the compute buffer).")
    notes: str = Field("", description="Anything a user should know about the figures.")
    reference: list[ReferencePoint] = Field(default_factory=list,
                                            description="Published decode measurements.")

    @field_validator("isa")
    @classmethod
    def _known_isa(cls, isa: list[str]) -> list[str]:
        unknown = sorted(set(isa) - ISA_FEATURES)
        if unknown:
            raise ValueError(f"unknown ISA feature(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(ISA_FEATURES))}")
        return isa

    @model_validator(mode="after")
    def _consistent(self) -> "DeviceProfile":
        if self.threads > self.cores * 2:
            raise ValueError(f"threads ({self.threads}) exceeds twice the cores ({self.cores})")
        if find_quant(self.gguf_quant) not in GGUF_TYPES:
            raise ValueError(f"gguf_quant {self.gguf_quant} is not a GGUF type "
                             f"({', '.join(GGUF_TYPES)})")
        for point in self.reference:
            if find_quant(point.quant) is None:
                raise ValueError(f"reference point {point.model}: unknown quant {point.quant} "
                                 f"({', '.join(BITS_PER_WEIGHT)})")
        return self

    @property
    def budget_bytes(self) -> float:
        """Bytes one app may use: RAM (GiB) times the app's share."""
        return self.ram_gb * 2**30 * self.app_memory_share


def search_dirs() -> list[Path]:
    """Directories holding profiles, lowest precedence first."""
    dirs = [BUNDLED_DIR, Path.home() / ".config" / "slm-align" / "devices"]
    if os.environ.get(ENV_DIR):
        dirs.append(Path(os.environ[ENV_DIR]).expanduser())
    return dirs


def profile_files() -> dict[str, Path]:
    """Profile name -> the file that defines it (user files override bundled
    ones of the same name)."""
    files: dict[str, Path] = {}
    for directory in search_dirs():
        if directory.is_dir():
            files.update({path.stem: path for path in sorted(directory.glob("*.toml"))})
    return files


def list_profiles() -> list[str]:
    """Names of every known device profile, sorted."""
    return sorted(profile_files())


def _validation_problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def read_profile(path: Path) -> DeviceProfile:
    """Parse and validate one profile file; a bad file is a one-line
    :class:`UserError` naming it."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"device profile {path}: not valid TOML ({exc}); "
                        "fix or remove the file") from None
    try:
        return DeviceProfile(name=path.stem, **data)
    except ValidationError as exc:
        raise UserError(f"device profile {path}: {_validation_problem(exc)}; "
                        "fix or remove the file") from None
    except TypeError as exc:  # e.g. a 'name' key in the file clashes with the file's stem
        raise UserError(f"device profile {path}: {exc}; fix or remove the file") from None


def load_profile(name: str) -> DeviceProfile:
    """The profile called ``name``; an unknown name is a :class:`UserError`
    listing the known ones."""
    files = profile_files()
    if name not in files:
        raise UserError(f"unknown device '{name}'; known devices: {', '.join(sorted(files))} (add "
                        f"your own TOML profile to ~/.config/slm-align/devices/ or ${ENV_DIR})")
    return read_profile(files[name])


def load_all_profiles() -> list[DeviceProfile]:
    """Every known profile, validated."""
    return [read_profile(path) for _, path in sorted(profile_files().items())]
