"""One artifact measured on this host (:class:`BenchResult`, written by ``slm-align bench``),
compared with a device profile's prediction, and saved as a user device profile with this
measurement as its reference point.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from pydantic import ValidationError

from slm_align.atomic import write_text_atomic
from slm_align.errors import UserError
from slm_align.ondevice.devices.estimate import estimate_fit
from slm_align.ondevice.devices.facts import model_facts
from slm_align.ondevice.devices.host import (
    BANDWIDTH_MB,
    BANDWIDTH_REPEATS,
    HostFacts,
    measure_bandwidth,
)
from slm_align.ondevice.devices.profiles import ENV_DIR, DeviceProfile, tomllib
from slm_align.ondevice.devices.quant import GGUF_TYPES

APP_MEMORY_SHARE = 0.7        # share of RAM a saved host profile lets one app use
PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class BenchResult:
    """One artifact measured on this host (speeds are medians over the repeats)."""

    artifact: str                        # the measured .gguf file or ONNX export directory
    kind: str                            # gguf (llama.cpp) or onnx (onnxruntime)
    # model name from the artifact (GGUF general.name, else the file/dir name)
    model: str
    runtime: str                         # runtime and version that ran it
    threads: int                         # threads the runtime was given
    n_ctx: int                           # context window the model was opened with
    prompt_tokens: int                   # tokens in the prompt fed at once
    # tokens generated after the first one, one forward pass each
    decode_tokens: int
    repeats: int                         # measurement repeats (the model is loaded once)
    # tokens generated per repeat: the first one plus decode_tokens
    generated_tokens: int
    # opening the artifact (weights, tokenizer, session/context)
    load_seconds: float
    time_to_first_token_seconds: float   # prompt fed to an empty cache plus the first token chosen
    prompt_tokens_per_second: float      # prompt processing speed
    decode_tokens_per_second: float      # greedy decode speed, the first token excluded
    decode_runs: list[float]             # decode tokens/s of each repeat
    # RSS high-water mark of the measuring process before loading the model
    rss_before_load_bytes: int
    peak_rss_bytes: int                  # RSS high-water mark of the measuring process at the end
    host: HostFacts                      # where it ran

    @property
    def model_rss_bytes(self) -> int:
        """Peak memory added by loading and running the model (peak minus the baseline)."""
        return self.peak_rss_bytes - self.rss_before_load_bytes

    @property
    def kv_context(self) -> int:
        """Tokens in the KV cache during decode, on average (the context a
        reference point records)."""
        return self.prompt_tokens + self.decode_tokens // 2

    def to_dict(self) -> dict:
        return dict(asdict(self), model_rss_bytes=self.model_rss_bytes)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchResult":
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**dict(data, host=HostFacts(**data["host"])))


def predict(result: BenchResult, profile) -> dict:
    """``estimate_fit``'s decode speed for the measured artifact on ``profile``,
    beside the measurement."""
    facts = model_facts(result.artifact)
    report = estimate_fit(facts, profile, quant=facts.quant, context=result.kv_context)
    return {"device": profile.name, "quant": report.quant, "context": report.context,
            "predicted_tokens_per_second": report.tokens_per_second,
            "measured_tokens_per_second": result.decode_tokens_per_second,
            "ratio": result.decode_tokens_per_second / report.tokens_per_second,
            "efficiency": report.efficiency.value, "efficiency_basis": report.efficiency.basis,
            "verdict": report.verdict}


def user_profile_dir() -> Path:
    """Where saved profiles go: $SLM_ALIGN_DEVICES if set, else ~/.config/slm-align/devices/."""
    return Path(os.environ[ENV_DIR]).expanduser() if os.environ.get(ENV_DIR) else \
        Path.home() / ".config" / "slm-align" / "devices"


def profile_path(name: str, overwrite: bool = False) -> Path:
    """The file a profile called ``name`` is saved to; refuses a bad name or an existing
    file (unless overwrite)."""
    if not PROFILE_NAME.match(name):
        raise UserError(f"--save-profile '{name}': use letters, digits, '.', '_' and "
                        "'-' only (e.g. my-laptop)")
    path = user_profile_dir() / f"{name}.toml"
    if path.exists() and not overwrite:
        raise UserError(f"device profile {path} already exists; pass --overwrite to replace it or "
                        f"choose another name")
    return path


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(data: dict) -> str:
    """Flat keys, then each list of dicts as an array of tables (all a device profile needs)."""
    tables = {key: value for key, value in data.items() if isinstance(value, list) and value
              and all(isinstance(item, dict) for item in value)}
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items()
             if key not in tables and value is not None]
    for key, rows in tables.items():
        for row in rows:
            lines += ["", f"[[{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in row.items()
                                           if v is not None]
    return "\n".join(lines) + "\n"


def _onnx_preset(isa: Sequence[str], machine: str) -> str:
    if "neon" in isa or machine.lower() in ("arm64", "aarch64"):
        return "arm64"
    return next((preset for preset in ("avx512_vnni", "avx512") if preset in isa), "avx2")


def profile_data(result: BenchResult, bandwidth_gbs: float, facts,
                 today: Optional[str] = None) -> dict:
    """A device profile (TOML keys) for this host, with ``result`` as its one reference point."""
    today = today or datetime.date.today().isoformat()
    host = result.host
    reference = None
    if facts.quant:
        reference = {"model": result.model, "parameters": facts.parameters, "quant": facts.quant,
                     "tokens_per_second": round(result.decode_tokens_per_second, 2),
                     "context": result.kv_context,
                     "size_gb": facts.weight_bytes / 1e9 if facts.weight_bytes else None,
                     "layers": facts.layers, "kv_heads": facts.kv_heads, "head_dim": facts.head_dim,
                     "runtime": result.runtime, "source": f"slm-align bench on this host, {today}"}
    return {
        "display_name": f"this host: {host.cpu}",
        "ram_gb": host.ram_gb,
        "app_memory_share": APP_MEMORY_SHARE,
        "cores": host.cores,
        "threads": result.threads,
        "isa": host.isa,
        "bandwidth_gbs": round(bandwidth_gbs, 2),
        "bandwidth_source": f"measured by slm-align bench with a numpy copy ({BANDWIDTH_MB} MB, "
                            f"best of {BANDWIDTH_REPEATS}, one thread), {today}",
        "runtime": result.kind,
        "gguf_quant": facts.quant if result.kind == "gguf" and facts.quant in GGUF_TYPES else "Q8_0",
        "onnx_preset": _onnx_preset(host.isa, host.machine),
        "notes": f"Written by `slm-align bench {result.artifact}` ({result.threads} threads, "
                 f"{result.prompt_tokens}-token prompt, {result.decode_tokens} decode tokens)."
                 + ("" if reference else " No reference point: the artifact's "
                                         "weight type is unknown."),
        "reference": [reference] if reference else [],
    }


def save_profile(result: BenchResult, name: str, overwrite: bool = False,
                 bandwidth_gbs: Optional[float] = None) -> Path:
    """Write ``result`` as the user device profile ``name`` (validated,
    atomically); the file's path."""
    path = profile_path(name, overwrite)
    data = profile_data(result, measure_bandwidth() if bandwidth_gbs is None else bandwidth_gbs,
                        model_facts(result.artifact))
    text = to_toml(data)
    try:
        DeviceProfile(name=name, **tomllib.loads(text))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        raise UserError(f"cannot save profile '{name}': "
                        f"{where + ': ' if where else ''}{error['msg']}") from None
    return write_text_atomic(path, text)
