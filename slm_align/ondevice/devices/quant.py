"""Weight types: bits per weight, the order in which a quantization is
downgraded, and name normalisation.

Bits per weight include the per-block scales (llama.cpp's published averages for the K-quant mixes).
"""

from __future__ import annotations

from typing import Optional

from slm_align.errors import UserError

BITS_PER_WEIGHT = {
    "F32": 32.0, "BF16": 16.0, "F16": 16.0,
    "Q8_0": 8.5, "Q6_K": 6.56, "Q5_1": 6.0, "Q5_K_M": 5.69, "Q5_K_S": 5.54, "Q5_0": 5.5,
    "Q4_1": 5.0, "Q4_K_M": 4.85, "Q4_K_S": 4.58, "Q4_0": 4.5, "Q3_K_L": 4.27, "Q3_K_M": 3.91,
    "Q3_K_S": 3.5, "Q2_K": 3.35,
    # w8: 8-bit weights with a float scale and a zero point per 32
    "w8": 9.25, "int8": 8.0, "int4": 4.5,
}
ONNX_TYPES = ["F32", "F16", "w8", "int8", "int4"]
GGUF_TYPES = [name for name in BITS_PER_WEIGHT if name not in ONNX_TYPES or name in ("F32", "F16")]
LADDERS = {"gguf": GGUF_TYPES, "onnx": ONNX_TYPES}
_BY_UPPER = {name.upper(): name for name in BITS_PER_WEIGHT} | {"FP32": "F32", "FP16": "F16", "Q4": "Q4_0",
                                                                 "Q8": "Q8_0", "INT4": "int4", "INT8": "int8",
                                                                 "W8": "w8"}


def find_quant(name: str) -> Optional[str]:
    """The canonical spelling of a weight type (case-insensitive), or None when unknown."""
    return _BY_UPPER.get(str(name).strip().upper())


def canonical_quant(name: str) -> str:
    """The canonical spelling of a weight type; an unknown one is a :class:`UserError`
    listing the known ones."""
    found = find_quant(name)
    if found is None:
        raise UserError(f"unknown quantization '{name}'; choose one of "
                        f"{', '.join(BITS_PER_WEIGHT)}")
    return found


def smaller_types(start: str, runtime: str) -> list[str]:
    """``start`` and every type of ``runtime`` with fewer bits per weight, largest first."""
    start = canonical_quant(start)
    ladder = sorted(LADDERS[runtime], key=lambda q: -BITS_PER_WEIGHT[q])
    return [q for q in ladder if BITS_PER_WEIGHT[q] <= BITS_PER_WEIGHT[start]]
