"""The words of a bundle: the README of a base + adapters bundle labels the base by its own GGUF type, read
from the file (a user's Q4_1 SmolLM2 is not called F16 because its adapters were exported as F16)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import gguf

from slm_align.export.packaging.adapter_bundle import base_file_type, describe_full, describe_update
from slm_align.export.packaging.bundle_readme import adapter_bundle_readme

SHA = "ab" * 32


def header_only_gguf(path: Path, file_type: Optional[gguf.LlamaFileType]) -> Path:
    """A GGUF with metadata and no tensors: all a reader of ``general.file_type`` needs."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def adapter_manifest() -> dict:
    """An adapter export's manifest as adapter_export writes it (the fields a bundle reads)."""
    return {"metrics": {"quant": "F16", "base": {"sha256": SHA}, "sha256": "cd" * 32,
                        "adapters": [{"path": "adapter-sft-F16.gguf", "stage": "sft", "sha256": "ef" * 32,
                                      "scale": 1.0}],
                        "verification": {"passed": True}}}


def test_the_base_type_is_read_from_the_gguf_header(tmp_path):
    assert base_file_type(header_only_gguf(tmp_path / "q41.gguf", gguf.LlamaFileType.MOSTLY_Q4_1)) == "Q4_1"
    assert base_file_type(header_only_gguf(tmp_path / "q8.gguf", gguf.LlamaFileType.MOSTLY_Q8_0)) == "Q8_0"
    assert base_file_type(header_only_gguf(tmp_path / "f32.gguf", gguf.LlamaFileType.ALL_F32)) == "F32"
    assert base_file_type(header_only_gguf(tmp_path / "none.gguf", None)) is None


def test_the_readme_labels_the_base_by_its_own_type_not_the_adapters(tmp_path):
    described = describe_full(adapter_manifest(), "smollm2-Q4_1.gguf", "iphone-15-pro", None, None,
                              base_file_type(header_only_gguf(tmp_path / "b.gguf", gguf.LlamaFileType.MOSTLY_Q4_1)))
    assert (described["quant"], described["base_quant"]) == ("F16", "Q4_1")  # the export's type is kept apart
    readme = adapter_bundle_readme(described)
    assert f"`model/smollm2-Q4_1.gguf`: the base model (GGUF, Q4_1, sha256 {SHA[:12]})" in readme
    assert "(GGUF, F16" not in readme
    older = dict(described, base_quant=None)  # a bundle.json from before the base's type was recorded
    assert f"the base model (GGUF, sha256 {SHA[:12]})" in adapter_bundle_readme(older)


def test_an_update_keeps_the_installed_bases_type():
    installed = {"base": "model/smollm2-Q4_1.gguf", "base_sha256": SHA, "model_id": "12" * 32,
                 "base_quant": "Q4_1", "adapters": [{"sha256": "34" * 32}], "tokenizer": "embedded in the base"}
    assert describe_update(adapter_manifest(), installed, None)["base_quant"] == "Q4_1"
