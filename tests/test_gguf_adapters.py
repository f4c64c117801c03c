"""Which base an adapter GGUF belongs to (slm_align.ondevice.gguf.adapter_check), read from headers alone
(slm_align.ondevice.gguf.fields): the refusals of a file that is no adapter, another architecture, a missing or
reshaped tensor and another base's hash, and the chain id of a base with adapters in order."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from slm_align.errors import UserError
from slm_align.ondevice.gguf.adapter_check import BASE_SHA256_KEY, chain_digest, check_adapter_base
from slm_align.ondevice.gguf.fields import read_fields, read_header
from slm_align.runs import sha256_file

OUT, IN, RANK = 8, 6, 2


def base_gguf(path: Path, arch: str = "llama", shape: tuple[int, int] = (OUT, IN)) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros(shape, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((10, IN), dtype=np.float32))
    _finish(writer)
    return path


def adapter_gguf(path: Path, base_sha256: str | None = None, kind: str = "adapter") -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", kind)
    writer.add_string("adapter.type", "lora")
    if base_sha256 is not None:
        writer.add_string(BASE_SHA256_KEY, base_sha256)
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((RANK, IN), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((OUT, RANK), dtype=np.float32))
    _finish(writer)
    return path


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_header_gives_fields_by_prefix_and_shapes_in_numpy_order(tmp_path):
    base = base_gguf(tmp_path / "base.gguf")
    fields, shapes = read_header(base)
    assert shapes == {"blk.0.attn_q.weight": (OUT, IN), "token_embd.weight": (10, IN)}
    assert fields["general.architecture"].value == "llama" and fields["llama.block_count"].value == 1
    assert set(read_fields(base, prefix="llama.")) == {"llama.block_count"}
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(UserError, match="is not a GGUF model .*export or download it again"):
        read_fields(tmp_path / "not.gguf")


def test_an_adapter_applies_to_the_base_it_was_made_for(tmp_path):
    base = base_gguf(tmp_path / "base.gguf")
    check_adapter_base(adapter_gguf(tmp_path / "a.gguf", sha256_file(base)), base)
    check_adapter_base(adapter_gguf(tmp_path / "unbound.gguf"), base)  # no hash recorded: shapes decide


def test_a_base_the_adapter_was_not_made_for_is_refused_in_one_line(tmp_path):
    base = base_gguf(tmp_path / "base.gguf")
    adapter = adapter_gguf(tmp_path / "a.gguf", sha256_file(base))
    refusals = {base_gguf(tmp_path / "qwen.gguf", arch="qwen2"): "is for a llama base, .* is qwen2",
                base_gguf(tmp_path / "wide.gguf", shape=(OUT, IN + 2)): "adapts blk.0.attn_q.weight as 8x6, .* has 8x8"}
    for other, reason in refusals.items():
        with pytest.raises(UserError, match=reason):
            check_adapter_base(adapter, other)
    same_shapes = tmp_path / "same-shapes.gguf"
    same_shapes.write_bytes(base.read_bytes() + b"\0")  # another file with the same header
    with pytest.raises(UserError, match=f"made for base sha256 {sha256_file(base)[:12]}"):
        check_adapter_base(adapter, same_shapes)
    check_adapter_base(adapter, same_shapes, check_hash=False)
    with pytest.raises(UserError, match="is not a LoRA adapter GGUF"):
        check_adapter_base(adapter_gguf(tmp_path / "model.gguf", kind="model"), base)
    with pytest.raises(UserError, match="is not a LoRA adapter GGUF"):
        check_adapter_base(base, base)


def test_a_chain_is_named_by_its_base_and_adapters_in_order():
    base, sft, dpo = "a" * 64, "b" * 64, "c" * 64
    assert chain_digest(base, []) == base  # the base alone is its own id
    assert chain_digest(base, [sft, dpo]) == hashlib.sha256(f"{base}\n{sft}\n{dpo}\n".encode()).hexdigest()
    assert chain_digest(base, [dpo, sft]) != chain_digest(base, [sft, dpo])
