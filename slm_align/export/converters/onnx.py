"""ONNX export: optimum's exporter with the KV cache, then onnxruntime's quantizers.

``fp32`` is optimum's graph as exported. ``int8`` is dynamic quantization (weights and activations)
with the preset of the target CPU (arm64, avx2, avx512, avx512_vnni). ``w8`` (the default) and
``int4`` are weight-only schemes on onnxruntime's MatMulNBits
(:mod:`slm_align.export.converters.onnx_quant`). ``--ort-format`` additionally converts the graph to
the ORT format that onnxruntime's reduced mobile builds read. The tokenizer files and the chat
template travel with the model.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from slm_align.errors import UserError
from slm_align.export.converters.onnx_quant import SCHEMES, quantize_weight_only

ONNX_QUANTS = tuple(SCHEMES)
ONNX_PRESETS = ("arm64", "avx2", "avx512", "avx512_vnni")
MODEL_FILE = "model.onnx"


def check_onnx_quant(quant: str, preset: str) -> tuple[str, str]:
    """Validated (quant, preset), or one line listing the choices."""
    if quant.lower() not in ONNX_QUANTS:
        raise UserError(f"unknown ONNX quantization '{quant}'; choose one of "
                        f"{', '.join(ONNX_QUANTS)}")
    if preset not in ONNX_PRESETS:
        raise UserError(f"unknown ONNX quantization preset '{preset}'; choose one of "
                        f"{', '.join(ONNX_PRESETS)}")
    return quant.lower(), preset


def host_preset() -> str:
    """The int8 preset that suits this machine's CPU."""
    import platform

    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "avx2"
    if "avx512_vnni" in flags or "avx512vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


def _optimum_export(model_dir: Path, out_dir: Path) -> None:
    try:
        from optimum.exporters.onnx import main_export
    except ImportError:
        raise UserError("ONNX export needs optimum's exporter: pip "
                        "install 'slm-align[export]'") from None
    with warnings.catch_warnings():
        # the tracer's advisories about data-dependent branches are not for users
        warnings.simplefilter("ignore")
        main_export(str(model_dir), output=str(out_dir), task="text-generation-with-past",
                    device="cpu", do_validation=False)


def _int8(out_dir: Path, preset: str) -> None:
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    config = getattr(AutoQuantizationConfig, preset)(is_static=False, per_channel=True)
    quantizer = ORTQuantizer.from_pretrained(str(out_dir), file_name=MODEL_FILE)
    quantized = quantizer.quantize(config, save_dir=str(out_dir), file_suffix="int8")
    _replace_model(out_dir, Path(quantized) / "model_int8.onnx")


def quantize_onnx(out_dir: Path, quant: str, preset: str) -> None:
    """Quantize ``out_dir``'s fp32 ``model.onnx`` in place by ``quant`` (see
    :mod:`slm_align.export.converters.onnx_quant`)."""
    if quant == "fp32":
        return
    if quant == "int8":
        _int8(out_dir, preset)
        return
    target = out_dir / f"model_{quant}.onnx"
    quantize_weight_only(out_dir / MODEL_FILE, target, SCHEMES[quant])
    _replace_model(out_dir, target)


def _replace_model(out_dir: Path, quantized: Path) -> None:
    """The quantized graph becomes ``model.onnx``; the fp32 graph and its external data go."""
    for stale in out_dir.glob("model.onnx*"):
        stale.unlink()
    quantized.rename(out_dir / MODEL_FILE)


def _to_ort_format(out_dir: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort",
                           str(out_dir / MODEL_FILE), "--output_dir", str(out_dir)],
                           capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ORT format conversion failed: {done.stderr.strip()[-500:]}")
    return out_dir / "model.ort"


def write_onnx(model_dir: Path, out_dir: Path, quant: str = "fp32", preset: str = "avx2",
               ort_format: bool = False) -> Path:
    """Export ``model_dir`` (plain HF checkpoint) into the empty directory ``out_dir``;
    returns the model file."""
    out_dir = Path(out_dir)
    _optimum_export(Path(model_dir), out_dir)
    quantize_onnx(out_dir, quant, preset)
    for leftover in ("ort_config.json",):
        (out_dir / leftover).unlink(missing_ok=True)
    if ort_format:
        _to_ort_format(out_dir)
    for copied in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja"):
        if (Path(model_dir) / copied).is_file() and not (out_dir / copied).exists():
            shutil.copy2(Path(model_dir) / copied, out_dir / copied)
    return out_dir / MODEL_FILE
