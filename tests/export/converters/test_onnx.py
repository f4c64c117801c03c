"""The ONNX converter's choices (export/converters/onnx.py): quant and preset names, the host's preset."""

from __future__ import annotations

import platform

import pytest

from slm_align.errors import UserError
from slm_align.export.converters.onnx import ONNX_PRESETS, ONNX_QUANTS, check_onnx_quant, host_preset


def test_quants_are_the_schemes():
    """Mutation: a scheme missing from the CLI's choices."""
    assert set(ONNX_QUANTS) == {"fp32", "int8", "w8", "int4"}


def test_quant_is_lowercased_and_preset_kept():
    """W8 -> w8 (mutation: case kept, which the scheme table would not find)."""
    assert check_onnx_quant("W8", "arm64") == ("w8", "arm64")


def test_unknown_quant_and_preset_are_refused_with_choices():
    """Each names the bad value and the choices (mutation: the preset not checked)."""
    with pytest.raises(UserError, match="unknown ONNX quantization 'q4'; choose one of fp32, int8, w8, int4"):
        check_onnx_quant("q4", "avx2")
    with pytest.raises(UserError, match="unknown ONNX quantization preset 'AVX2'; choose one of arm64"):
        check_onnx_quant("w8", "AVX2")


def machine_named(name: str):
    """A stand-in for platform.machine naming ``name``."""
    def machine() -> str:
        return name
    return machine


@pytest.mark.parametrize("machine", ["arm64", "aarch64", "AArch64"])
def test_arm_hosts_get_the_arm_preset(monkeypatch, machine):
    """Mutation: machine names compared case-sensitively, or arm hosts given an x86 preset."""
    monkeypatch.setattr(platform, "machine", machine_named(machine))
    assert host_preset() == "arm64"


def test_x86_host_preset_is_one_of_the_presets(monkeypatch):
    """On x86 the preset comes from the CPU flags and is always a valid choice (mutation: a misspelt preset)."""
    monkeypatch.setattr(platform, "machine", machine_named("x86_64"))
    assert host_preset() in ONNX_PRESETS and host_preset() != "arm64"
