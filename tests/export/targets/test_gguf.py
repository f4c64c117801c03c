"""``--target gguf`` (export/targets/gguf.py): quant names, artifact names, which types calibrate, and
the build path (written directly, or F32 then llama.cpp's quantizer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gguf import GGUFReader

from slm_align.errors import UserError
from slm_align.export.targets.gguf import GgufTarget
from slm_align.ondevice.gguf.writer import QUANTIZER_TYPES
from tests.conftest import save_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    return save_tiny("llama", tokenizer, tmp_path_factory.mktemp("tiny") / "llama")


def test_quant_is_normalised_and_preset_kept():
    """q4_k_m -> Q4_K_M, the preset passed through (mutation: case kept, preset dropped)."""
    assert GgufTarget().check_quant("q4_k_m", "mobile") == ("Q4_K_M", "mobile")


def test_unknown_quant_is_refused_with_choices():
    """Mutation: an unknown type reaches the writer."""
    with pytest.raises(UserError, match="unknown GGUF quantization 'q9'; choose one of F32"):
        GgufTarget().check_quant("q9", "")


def test_only_quantizer_types_calibrate():
    """The importance matrix helps llama.cpp's quantizer types, not Q8_0/F16 written directly
    (mutation: every type calibrated)."""
    target = GgufTarget()
    assert target.calibrates("Q4_K_M") and target.calibrates("IQ4_XS")
    assert not target.calibrates("Q8_0") and not target.calibrates("F16")


def test_names_and_device_quant():
    """Artifact named after its type; a device profile's gguf_quant used (mutation: onnx_quant read)."""
    target = GgufTarget()
    assert target.artifact_name("Q8_0") == "model-Q8_0.gguf"
    assert target.device_quant(SimpleNamespace(gguf_quant="Q4_0", onnx_quant="int4")) == "Q4_0"
    assert target.default_quant == "Q8_0" and target.default_quant in target.ladder


def test_system_prompt_with_triple_quotes_is_refused():
    """The Modelfile cannot quote '\"\"\"' (mutation: check_system a no-op)."""
    GgufTarget().check_system("Be brief.")
    with pytest.raises(UserError, match="a Modelfile cannot quote"):
        GgufTarget().check_system('say """hi"""')


def test_build_writes_direct_types_and_quantizes_the_others(tiny_llama, tmp_path):
    """Q8_0 is written directly; Q4_0 goes through an F32 file that is removed afterwards
    (mutation: the F32 intermediate left behind, or the quantizer skipped)."""
    assert "Q4_0" in QUANTIZER_TYPES
    target = GgufTarget()
    settings = {"template": None, "threads": 1, "importance": None}
    direct = target.build(tiny_llama, tmp_path, "Q8_0", settings)
    assert direct == tmp_path / "model-Q8_0.gguf"
    quantized = target.build(tiny_llama, tmp_path, "Q4_0", settings)
    assert quantized == tmp_path / "model-Q4_0.gguf"
    assert not (tmp_path / "f32.gguf").exists()
    kinds = {tensor.tensor_type.name for tensor in GGUFReader(str(quantized)).tensors}
    assert "Q4_0" in kinds
    assert "Q4_0" not in {tensor.tensor_type.name for tensor in GGUFReader(str(direct)).tensors}
