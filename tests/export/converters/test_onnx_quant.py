"""ONNX weight-only schemes (export/converters/onnx_quant.py) on a hand-built decoder-shaped graph:
ids -> Gather(embedding) -> q_proj -> down_proj -> lm_head, run with onnxruntime before and after."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from slm_align.export.converters.onnx_quant import (
    HEAD_NODE,
    SCHEMES,
    _int8_rows,
    quantize_weight_only,
)

VOCAB = 48
HIDDEN = 64
IDS = np.array([0, 5, 47, 12], dtype=np.int64)


def decoder(tied: bool, seed: int = 0) -> onnx.ModelProto:
    """A graph with the node names optimum gives Gemma's decoder; the head is the embedding transposed
    when ``tied`` (as optimum exports tied weights: two copies)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(VOCAB, HIDDEN)).astype(np.float32)
    head = table.T.copy() if tied else rng.normal(size=(HIDDEN, VOCAB)).astype(np.float32)
    weights = [numpy_helper.from_array(table, "embed.weight"),
               numpy_helper.from_array(rng.normal(size=(HIDDEN, HIDDEN)).astype(np.float32) / 8, "q.weight"),
               numpy_helper.from_array(rng.normal(size=(HIDDEN, HIDDEN)).astype(np.float32) / 8, "down.weight"),
               numpy_helper.from_array(head, "head.weight")]
    nodes = [helper.make_node("Gather", ["embed.weight", "ids"], ["x"], name="/model/embed_tokens/Gather"),
             helper.make_node("MatMul", ["x", "q.weight"], ["q"], name="/model/layers.0/self_attn/q_proj/MatMul"),
             helper.make_node("MatMul", ["q", "down.weight"], ["d"], name="/model/layers.0/mlp/down_proj/MatMul"),
             helper.make_node("MatMul", ["d", "head.weight"], ["logits"], name=HEAD_NODE)]
    graph = helper.make_graph(nodes, "decoder", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, VOCAB])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def logits(path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": IDS})[0]


def quantized(tmp_path, scheme: str, tied: bool):
    source = tmp_path / "fp32.onnx"
    onnx.save_model(decoder(tied), str(source))
    target = quantize_weight_only(source, tmp_path / f"{scheme}.onnx", SCHEMES[scheme])
    return logits(source), logits(target), onnx.load(str(target))


def nbits(model) -> dict[str, int]:
    """MatMulNBits node name -> its bits."""
    return {node.name: next(a.i for a in node.attribute if a.name == "bits")
            for node in model.graph.node if node.op_type == "MatMulNBits"}


def test_int8_rows_round_trip_within_half_a_step():
    """Each row's scale is its peak / 127; a zero row keeps scale 1 (mutation: one scale for the table,
    or a division by zero)."""
    weight = np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 3.0, -50.0]], dtype=np.float32)
    values, scale = _int8_rows(weight)
    assert values.dtype == np.int8 and scale.shape == (3, 1)
    np.testing.assert_allclose(scale[:, 0], [2.0 / 127, 1.0, 100.0 / 127], rtol=1e-6)
    assert np.all(np.abs(values * scale - weight) <= scale / 2 + 1e-6)
    assert values[0, 1] == -127 and values[2, 0] == 127


def test_w8_tied_shares_the_heads_blocks_and_keeps_the_logits(tmp_path):
    """w8 on a tied model: every MatMul 8-bit, the embedding table dropped (read from the head's blocks),
    logits close to fp32 (mutation: the shared Gather reading wrong rows, or the table kept)."""
    before, after, model = quantized(tmp_path, "w8", tied=True)
    assert set(nbits(model).values()) == {8} and len(nbits(model)) == 3
    names = {init.name for init in model.graph.initializer}
    assert "embed.weight" not in names and "embed.weight_int8" not in names
    assert np.abs(after - before).max() < 0.05 * np.abs(before).max()
    assert (after.argmax(axis=1) == before.argmax(axis=1)).all()


def test_w8_untied_embedding_gets_its_own_int8_rows(tmp_path):
    """An untied embedding is stored as int8 rows with scales (mutation: an untied table shared with the
    head, which would give other numbers)."""
    before, after, model = quantized(tmp_path, "w8", tied=False)
    names = {init.name for init in model.graph.initializer}
    assert {"embed.weight_int8", "embed.weight_scale"} <= names and "embed.weight" not in names
    assert np.abs(after - before).max() < 0.05 * np.abs(before).max()


def test_int4_keeps_sensitive_layers_and_the_head_at_8_bits(tmp_path):
    """int4: q_proj 4-bit, down_proj and lm_head 8-bit (mutation: SENSITIVE_LAYERS or the head pass lost)."""
    before, after, model = quantized(tmp_path, "int4", tied=True)
    bits = nbits(model)
    assert [bits[name] for name in sorted(bits)] == [8, 8, 4]  # /lm_head, /model/...down_proj, ...q_proj
    assert sorted(bits)[0].startswith(HEAD_NODE)
    assert np.abs(after - before).max() < 0.2 * np.abs(before).max()


@pytest.mark.parametrize("scheme", ["fp32", "int8"])
def test_schemes_without_weight_only_bits(scheme):
    """fp32 and int8 are not weight-only passes (mutation: bits set on them)."""
    chosen = SCHEMES[scheme]
    assert (chosen.body_bits, chosen.head_bits, chosen.embedding_bits) == (None, None, None)
