"""Weight types (devices/quant.py): names, bits, the downgrade ladders."""

from __future__ import annotations

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.devices.quant import (
    BITS_PER_WEIGHT,
    GGUF_TYPES,
    ONNX_TYPES,
    canonical_quant,
    find_quant,
    smaller_types,
)


@pytest.mark.parametrize("name, canonical", [
    ("q4_k_m", "Q4_K_M"), (" Q8_0 ", "Q8_0"), ("fp16", "F16"), ("q4", "Q4_0"), ("INT4", "int4"),
    ("W8", "w8"), ("bf16", "BF16"),
])
def test_names_are_normalised(name, canonical):
    """Case, spaces and aliases map to one spelling (mutation: case-sensitive lookup, an alias lost)."""
    assert find_quant(name) == canonical
    assert canonical_quant(name) == canonical


def test_unknown_name_is_none_or_a_one_line_refusal():
    """find_quant says None; canonical_quant names the bad value and lists the known ones (mutation: KeyError)."""
    assert find_quant("q9_z") is None
    with pytest.raises(UserError) as caught:
        canonical_quant("q9_z")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("unknown quantization 'q9_z'; choose one of F32, BF16")
    assert "Q4_K_M" in message


def test_ladders_split_by_runtime():
    """GGUF has the K-quants and F32/F16 but not int4; ONNX the reverse (mutation: ladder filter wrong)."""
    assert "Q4_K_M" in GGUF_TYPES and "int4" not in GGUF_TYPES and "w8" not in GGUF_TYPES
    assert {"F32", "F16"} <= set(GGUF_TYPES)
    assert "Q4_K_M" not in ONNX_TYPES


def test_smaller_types_go_down_in_bits_from_the_start():
    """The start first, then every type with fewer bits, largest first (mutation: order or <= bound)."""
    ladder = smaller_types("q4_k_m", "gguf")
    assert ladder[0] == "Q4_K_M"
    assert ladder == ["Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K"]
    bits = [BITS_PER_WEIGHT[name] for name in ladder]
    assert bits == sorted(bits, reverse=True)


def test_smaller_types_stay_in_the_runtime():
    """An ONNX ladder holds ONNX types only (mutation: every known type listed)."""
    assert smaller_types("F16", "onnx") == ["F16", "w8", "int8", "int4"]


def test_smaller_types_refuses_an_unknown_start():
    """Mutation: an unknown start silently gives an empty ladder."""
    with pytest.raises(UserError, match="unknown quantization"):
        smaller_types("q7", "gguf")
