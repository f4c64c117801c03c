"""ONNX quantization schemes, applied to optimum's fp32 decoder graph.

A scheme names what happens to three groups of weights: the layers' MatMuls (the body), the output
projection (``lm_head``) and the token embedding (its ``Gather``). Gemma 3's 262k x 640 embedding is
62% of its weights and is tied to the output, so how those two are stored decides both the size and
the agreement with PyTorch.

- ``fp32``: optimum's graph as exported.
- ``int8``: dynamic int8 of every MatMul, weights and activations (the preset's kernels).
- ``w8`` (the default): 8-bit weights; every MatMul a ``MatMulNBits`` (bits 8, block 32, asymmetric,
  accuracy level 4). The embedding: when it is tied to ``lm_head`` (optimum exports the two as
  separate copies of the same numbers), its Gather reads the head's 8-bit blocks by token, so the
  vocabulary is stored once; otherwise int8 rows with one scale each. Standard ops (Gather, Cast,
  Sub, Mul, Reshape) either way.
- ``int4``: 4-bit body (``MatMulNBits``, block 16, asymmetric, accuracy level 4); ``v_proj`` and
  ``down_proj`` kept 8-bit (as llama.cpp's Q4_K_M keeps attn_v and ffn_down at 6 bits),
  ``lm_head`` and the embedding 8-bit.

Measured on the real Gemma 3 270M (benchmarks/quantization.py, README): dynamic int8 (0.801) and a
uniform 4-bit body lose agreement; symmetric 4-bit lost more than asymmetric, block 32 (0.812) more
than 16 (0.858), and the 8-bit v/down layers bought the most. No 4-bit variant reached 0.9: also
keeping o_proj (0.870), q/k_proj (0.874) or gate/up_proj (0.885) at 8 bits, float compute (accuracy
level unset, 0.870, far slower) and onnxruntime's k-quant scale search for the 4-bit blocks (0.801)
all fell short of w8 (0.927). (Those figures are from before the tied embedding was shared; sharing
it took w8 from 514 to 346 MB and 0.927 to 0.958, int4 from 487 to 318 MB at 0.851. With it,
gate/up_proj at 8 bits too reached 0.904 at 336 MB: 4 bits left only in q/k/o, 3% smaller than w8.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slm_align.errors import UserError

HEAD_NODE = "/lm_head/MatMul"
SENSITIVE_LAYERS = ("v_proj/", "down_proj/")
# MatMulNBits' accuracy level 4: activations rounded to int8 per block inside the kernel (MLAS's
# int8 paths on x86 and Arm). On the real Gemma it decoded 19.5 tok/s against 0.6 at the default
# (fp32 compute, which has no fast 8-bit kernel) at the same agreement (0.935 vs 0.931).
INT8_COMPUTE = 4
EIGHT_BIT_BLOCK = 32


@dataclass(frozen=True)
class Scheme:
    """Bits of each weight group (None: kept fp32) and the weight-only quantizer's settings."""

    name: str
    body_bits: Optional[int]
    head_bits: Optional[int]
    embedding_bits: Optional[int]
    block_size: int = 32
    eight_bit_layers: tuple[str, ...] = ()
    """Body MatMuls (by name fragment) kept 8-bit."""
    accuracy_level: Optional[int] = None


SCHEMES = {
    "fp32": Scheme("fp32", None, None, None),
    "int8": Scheme("int8", None, None, None),
    "w8": Scheme("w8", 8, 8, 8, accuracy_level=INT8_COMPUTE),
    "int4": Scheme("int4", 4, 8, 8, block_size=16, eight_bit_layers=SENSITIVE_LAYERS,
                   accuracy_level=INT8_COMPUTE),
}


def _matmul_nbits(model, bits: int, include: Optional[list[str]], exclude: list[str],
                  scheme: Scheme):
    """One pass of onnxruntime's weight-only quantizer over the MatMul nodes named (all when None);
    8-bit passes use blocks of 32 (smaller blocks buy 8 bits nothing but scales)."""
    block_size = scheme.block_size if bits < 8 else EIGHT_BIT_BLOCK
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    # It logs a line for every node it skips, at INFO and (for each non-MatMul node,
    # when bits is 8) at ERROR.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.CRITICAL)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=False,
                                          accuracy_level=scheme.accuracy_level,
                                          op_types_to_quantize=("MatMul",),
                                          quant_axes=(("MatMul", 0),), bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=False,
                                     accuracy_level=scheme.accuracy_level, nodes_to_include=include,
                                     nodes_to_exclude=exclude, algo_config=config)
    quantizer.process()
    return quantizer.model.model


def _embedding_gathers(model) -> list:
    """The graph's Gather nodes that read a 2-D float initializer (the token embedding)."""
    weights = {init.name for init in model.graph.initializer
               if len(init.dims) == 2 and init.data_type == 1}
    return [node for node in model.graph.node
            if node.op_type == "Gather" and node.input[0] in weights]


def _int8_rows(weight):
    """Symmetric int8 of each row and its scale (a zero row keeps scale 1)."""
    import numpy as np

    peak = np.abs(weight).max(axis=1, keepdims=True)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    return np.round(weight / scale).astype(np.int8), scale


def _int8_embedding(model, gather) -> None:
    """``gather``'s table as int8 rows with one fp32 scale each: Gather both, Cast,
    Mul (standard ops only)."""
    from onnx import TensorProto, helper, numpy_helper

    table = next(init for init in model.graph.initializer if init.name == gather.input[0])
    quantized, scale = _int8_rows(numpy_helper.to_array(table))
    base = gather.input[0]
    model.graph.initializer.remove(table)
    model.graph.initializer.extend([numpy_helper.from_array(quantized, f"{base}_int8"),
                                    numpy_helper.from_array(scale, f"{base}_scale")])
    output = gather.output[0]
    nodes = [helper.make_node("Gather", [f"{base}_int8", gather.input[1]], [f"{output}_int8"],
                              name=f"{gather.name}_int8"),
             helper.make_node("Gather", [f"{base}_scale", gather.input[1]], [f"{output}_scale"],
                              name=f"{gather.name}_scale"),
             helper.make_node("Cast", [f"{output}_int8"], [f"{output}_float"], to=TensorProto.FLOAT,
                              name=f"{gather.name}_cast"),
             helper.make_node("Mul", [f"{output}_float", f"{output}_scale"], [output],
                              name=f"{gather.name}_dequant")]
    position = list(model.graph.node).index(gather)
    model.graph.node.remove(gather)
    for offset, node in enumerate(nodes):
        model.graph.node.insert(position + offset, node)


def _initializer(model, name: str):
    return next((init for init in model.graph.initializer if init.name == name), None)


def _tied_to_head(model, gather) -> bool:
    """Whether the output projection's weight (hidden x vocab) is ``gather``'s table (vocab x
    hidden) transposed: a model with tied embeddings, which optimum exports as two initializers
    holding the same numbers."""
    import numpy as np
    from onnx import numpy_helper

    head = next((node for node in model.graph.node if node.name == HEAD_NODE), None)
    weight = _initializer(model, head.input[1]) if head is not None else None
    table = _initializer(model, gather.input[0])
    if weight is None or tuple(weight.dims) != tuple(reversed(table.dims)):
        return False
    return bool(np.array_equal(numpy_helper.to_array(weight).T, numpy_helper.to_array(table)))


def _shareable_head(model):
    """The 8-bit ``MatMulNBits`` output projection whose blocks tile its input
    width exactly, or None."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.name.startswith(HEAD_NODE) and len(node.input) >= 4 and opset >= 13:
            attributes = {a.name: a.i for a in node.attribute}
            if attributes["bits"] == 8 and attributes["K"] % attributes["block_size"] == 0:
                return node
    return None


def _shared_embedding(model, gather, head) -> None:
    """``gather`` reads the token rows of ``head``'s 8-bit blocks (uint8 [vocab, blocks, block], a
    scale and a zero point per block) instead of its own table, which is dropped: for tied
    embeddings the vocabulary is stored once. Row t is ``(B[t] - zero[t, :, None]) * scale[t, :,
    None]``, reshaped to the hidden width (standard ops only)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    blocks, scales, zeros = head.input[1:4]
    width = next(a.i for a in head.attribute if a.name == "K")
    ids = gather.input[1]
    out = gather.output[0]
    name = gather.name
    model.graph.initializer.extend([numpy_helper.from_array(np.array([-1], dtype=np.int64),
                                                            f"{name}_last_axis"),
                                    numpy_helper.from_array(np.array([width], dtype=np.int64),
                                                            f"{name}_width")])
    nodes = [helper.make_node("Gather", [blocks, ids], [f"{out}_q8"], name=f"{name}_q8"),
             helper.make_node("Gather", [zeros, ids], [f"{out}_zero"], name=f"{name}_zero"),
             helper.make_node("Gather", [scales, ids], [f"{out}_scale"], name=f"{name}_scale"),
             helper.make_node("Cast", [f"{out}_q8"], [f"{out}_q8_float"], to=TensorProto.FLOAT,
                              name=f"{name}_cast"),
             helper.make_node("Cast", [f"{out}_zero"], [f"{out}_zero_float"], to=TensorProto.FLOAT,
                              name=f"{name}_cast_zero"),
             helper.make_node("Unsqueeze", [f"{out}_zero_float", f"{name}_last_axis"],
                              [f"{out}_zero_column"], name=f"{name}_zero_column"),
             helper.make_node("Unsqueeze", [f"{out}_scale", f"{name}_last_axis"],
                              [f"{out}_scale_column"], name=f"{name}_scale_column"),
             helper.make_node("Sub", [f"{out}_q8_float", f"{out}_zero_column"], [f"{out}_centered"],
                              name=f"{name}_center"),
             helper.make_node("Mul", [f"{out}_centered", f"{out}_scale_column"], [f"{out}_blocks"],
                              name=f"{name}_dequant"),
             helper.make_node("Shape", [ids], [f"{out}_ids_shape"], name=f"{name}_ids_shape"),
             helper.make_node("Concat", [f"{out}_ids_shape", f"{name}_width"], [f"{out}_shape"],
                              axis=0, name=f"{name}_shape"),
             helper.make_node("Reshape", [f"{out}_blocks", f"{out}_shape"], [out],
                              name=f"{name}_rows")]
    model.graph.initializer.remove(_initializer(model, gather.input[0]))
    position = list(model.graph.node).index(gather)
    model.graph.node.remove(gather)
    for offset, node in enumerate(nodes):
        model.graph.node.insert(position + offset, node)


def _consumers(model, name: str) -> list:
    """The nodes that read the tensor ``name``."""
    return [node for node in model.graph.node if name in node.input]


def _fold_head_transpose(model) -> None:
    """Give the output projection an initializer of its own when optimum wrote a tied head as
    ``MatMul(hidden, Transpose(embedding))`` (the bundled model): the weight-only quantizer only
    rewrites a MatMul whose weight is an initializer, and the embedding passes below replace the
    table the Transpose reads. The head then holds the transposed table, which
    :func:`_tied_to_head` recognises as tied."""
    import numpy as np
    from onnx import numpy_helper

    head = next((node for node in model.graph.node if node.name == HEAD_NODE), None)
    if head is None or _initializer(model, head.input[1]) is not None:
        return
    producer = next((node for node in model.graph.node if head.input[1] in node.output), None)
    if producer is None or producer.op_type != "Transpose":
        return
    table = _initializer(model, producer.input[0])
    if table is None:
        return
    perm = next((list(a.ints) for a in producer.attribute if a.name == "perm"), None)
    weight = np.transpose(numpy_helper.to_array(table), perm)
    name = f"{HEAD_NODE}_weight"
    model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight), name))
    head.input[1] = name
    if not _consumers(model, producer.output[0]):
        model.graph.node.remove(producer)


def _weight_only(model, scheme: Scheme):
    """The scheme's weight-only passes: body, then lm_head, then the embedding (sharing the 8-bit
    head's blocks when the two are tied, else int8 rows of its own)."""
    _fold_head_transpose(model)
    eight = [node.name for node in model.graph.node
             if any(part in node.name for part in scheme.eight_bit_layers)]
    tied = {gather.name for gather in _embedding_gathers(model) if _tied_to_head(model, gather)}
    if scheme.body_bits is not None:
        model = _matmul_nbits(model, scheme.body_bits, None, [HEAD_NODE, *eight], scheme)
    if eight:
        model = _matmul_nbits(model, 8, eight, [], scheme)
    if scheme.head_bits is not None:
        model = _matmul_nbits(model, scheme.head_bits, [HEAD_NODE], [], scheme)
    if scheme.embedding_bits == 8:
        head = _shareable_head(model)
        for gather in _embedding_gathers(model):
            if gather.name in tied and head is not None:
                _shared_embedding(model, gather, head)
            else:
                _int8_embedding(model, gather)
    return model


def quantize_weight_only(source: Path, target: Path, scheme: Scheme) -> Path:
    """Write ``source`` quantized by ``scheme``'s weight-only passes to ``target`` (one file)."""
    try:
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: F401
    except ImportError:
        raise UserError(f"ONNX {scheme.name} needs onnxruntime's MatMulNBits quantizer (pip "
                        "install onnx-ir); use --quant int8 instead") from None
    model = _weight_only(onnx.load(str(source)), scheme)
    onnx.save_model(model, str(target), save_as_external_data=False)
    return target
