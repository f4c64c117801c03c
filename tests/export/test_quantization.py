"""ONNX quantization schemes: which nodes stay in higher precision, the default,
and what a refusal advises.

Agreement figures on real weights live in benchmarks/quantization.py and the README, not here.
"""

import json

import onnx
import pytest

from slm_align.export.publishing.stage import ExportRequest, VerificationFailed, next_higher, run_export
from slm_align.modeling.models import DEFAULT_MODEL_DIR

pytest.importorskip("onnxruntime")


def _graph(artifact):
    return onnx.load(str(artifact / "model.onnx")).graph


def _bits_by_node(graph, attribute: str = "bits") -> dict:
    """Each MatMulNBits node's name and its ``bits`` (or another integer) attribute."""
    bits = {}
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            bits[node.name] = next(a.i for a in node.attribute if a.name == attribute)
    return bits


def _float_weight_matmuls(graph) -> list:
    """MatMul nodes that still multiply by a float 2-D initializer (a weight left unquantized)."""
    float32 = onnx.TensorProto.FLOAT
    weights = {init.name for init in graph.initializer if len(init.dims) == 2 and init.data_type == float32}
    return [node.name for node in graph.node if node.op_type == "MatMul" and set(node.input) & weights]


def _embedding_table_types(graph) -> set:
    """Element types of the 2-D initializers the graph's Gather nodes read (the token embedding)."""
    tables = {init.name: init.data_type for init in graph.initializer if len(init.dims) == 2}
    return {tables[node.input[0]] for node in graph.node if node.op_type == "Gather" and node.input[0] in tables}


def test_default_onnx_export_is_8bit_weight_only_and_passes(tmp_path, tiny_models):
    metrics = run_export(ExportRequest(str(tiny_models["llama"]), "onnx", out=tmp_path)).metrics
    assert metrics["quant"] == "w8" and metrics["verification"]["passed"]
    graph = _graph(tmp_path / "onnx-w8")
    bits = _bits_by_node(graph)
    assert bits and set(bits.values()) == {8} and "/lm_head/MatMul_Q8" in bits
    assert _float_weight_matmuls(graph) == []  # every weight MatMul became MatMulNBits
    assert _embedding_table_types(graph) == {onnx.TensorProto.INT8, onnx.TensorProto.FLOAT}  # int8 rows, fp32 scales
    verification = metrics["verification"]
    assert verification["perplexity"] > 0 and verification["torch_perplexity"] > 0


def test_int4_keeps_output_embedding_and_sensitive_layers_at_8_bits(tmp_path, tiny_models):
    run_export(ExportRequest(str(tiny_models["qwen2"]), "onnx", "int4", out=tmp_path, min_agreement=0.0))
    graph = _graph(tmp_path / "onnx-int4")
    bits = _bits_by_node(graph)
    eight = {name for name, value in bits.items() if value == 8}
    four = {name for name, value in bits.items() if value == 4}
    layers = eight - {"/lm_head/MatMul_Q8"}
    assert "/lm_head/MatMul_Q8" in eight
    assert layers and all("v_proj" in n or "down_proj" in n for n in layers)
    assert four and not any("v_proj" in n or "down_proj" in n for n in four)
    blocks = _bits_by_node(graph, "block_size")
    assert {blocks[n] for n in four} == {16} and {blocks[n] for n in eight} == {32}
    assert set(_bits_by_node(graph, "accuracy_level").values()) == {4}  # int8 compute: the fast kernels
    assert _float_weight_matmuls(graph) == []
    assert onnx.TensorProto.INT8 in _embedding_table_types(graph)


@pytest.mark.parametrize("model, quant", [("gemma3_text", "w8"), ("gemma3_text", "int4"), ("bundled", "w8"),
                                          ("bundled", "int4")])
def test_tied_embedding_reads_the_output_projection_blocks(tmp_path, tiny_models, model, quant):
    """Gemma ties its embedding to the output projection: the vocabulary is stored once, as the
    head's 8-bit blocks, and the embedding Gather reads them (no float or int8 table of its own).
    optimum writes the bundled Llama's tied head as MatMul(hidden, Transpose(embedding)) instead of
    a second copy: the same holds, and the graph loads."""
    source = DEFAULT_MODEL_DIR
    if model != "bundled":
        source = tiny_models[model]
    metrics = run_export(ExportRequest(str(source), "onnx", quant, out=tmp_path, min_agreement=0.0)).metrics
    graph = _graph(tmp_path / f"onnx-{quant}")
    head = next(node for node in graph.node if node.name == "/lm_head/MatMul_Q8")
    tokens = json.loads((tmp_path / f"onnx-{quant}" / "config.json").read_text())["vocab_size"]
    vocabulary = {init.name for init in graph.initializer if init.dims and init.dims[0] == tokens}
    gathered = {node.input[0] for node in graph.node if node.op_type == "Gather"}
    assert set(head.input[1:4]) <= gathered  # blocks, scales and zero points, by token
    assert vocabulary == set(head.input[1:4])  # and nothing else holds a row per token
    assert metrics["verification"]["agreement"] >= (0.9 if quant == "w8" else 0.0)


def test_dynamic_int8_is_still_offered(tmp_path, tiny_models):
    metrics = run_export(ExportRequest(str(tiny_models["llama"]), "onnx", "int8", preset="avx2", out=tmp_path,
                                       min_agreement=0.0)).metrics
    ops = {node.op_type for node in _graph(tmp_path / "onnx-int8").node}
    assert metrics["quant"] == "int8" and "MatMulInteger" in ops and "MatMulNBits" not in ops


def test_refusal_reports_perplexity_and_names_the_next_higher_scheme(tmp_path, tiny_models):
    request = ExportRequest(str(tiny_models["llama"]), "onnx", "int4", out=tmp_path, min_agreement=1.0)
    with pytest.raises(VerificationFailed, match=r"perplexity [\d.]+ -> [\d.]+, [+-][\d.]+%") as refused:
        run_export(request)
    assert "--quant w8 " in str(refused.value) and list(tmp_path.iterdir()) == []


def test_perplexity_change_is_printed_beside_agreement(capsys):
    from slm_align.cli.render import print_export
    from slm_align.export.publishing.parity import perplexity_change

    verification = {"tokenizer_match": True, "prompts": 0, "ties": [], "passed": True, "agreement": 0.95,
                    "agreement_positions": 141, "torch_perplexity": 20.0, "perplexity": 22.5}
    assert perplexity_change(verification) == "perplexity 20.00 -> 22.50, +12.5%"
    assert perplexity_change({"agreement": 0.95}) == ""  # a record from before perplexity was measured
    print_export({"dir": "out/onnx-w8", "metrics": {"target": "onnx", "quant": "w8", "bytes": 1e6,
                                                     "export_seconds": 1.0, "verification": verification}})
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert "top-1 agreement 0.950 over 141 tokens, held-out perplexity 20.00 -> 22.50, +12.5%" in printed


LADDER_CASES = [("onnx", "int4", "w8"), ("onnx", "int8", "w8"), ("onnx", "w8", "fp32"), ("onnx", "fp32", None),
                ("gguf", "Q4_K_M", "Q5_K_M"), ("gguf", "Q2_K", "Q4_0"), ("gguf", "Q8_0", "F16")]


@pytest.mark.parametrize("target, quant, higher", LADDER_CASES)
def test_next_higher_precision(target, quant, higher):
    assert next_higher(target, quant) == higher


def test_importance_matrix_reaches_llama_cpp_quantizer(tmp_path, tiny_models):
    """Every Linear's statistic is named as the converter names its tensor, and
    llama.cpp's quantizer uses it."""
    import gguf

    from slm_align.export.converters.imatrix import activation_importance, gguf_importance
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source
    from slm_align.ondevice.gguf.writer import quantize_gguf, write_gguf

    source = resolve_source(str(tiny_models["llama"]))
    model = load_model(source)
    ids = [load_tokenizer(source)("Once upon a time there was a "
                                  "cat who liked the sea.")["input_ids"]]
    importance = gguf_importance(tiny_models["llama"], activation_importance(model, ids))
    full = write_gguf(tiny_models["llama"], tmp_path / "f32.gguf", "F32")
    matrices = {t.name for t in gguf.GGUFReader(str(full)).tensors if len(t.shape) == 2}
    assert "blk.0.attn_q.weight" in importance and set(importance) <= matrices
    assert all(values.shape == (model.config.hidden_size,) for name, values in importance.items()
               if "ffn_down" not in name and "attn_output" not in name)
    plain = quantize_gguf(full, tmp_path / "plain.gguf", "Q4_0")
    weighted = quantize_gguf(full, tmp_path / "weighted.gguf", "Q4_0", importance=importance)
    assert plain.read_bytes() != weighted.read_bytes()  # the same type, other rounding: the matrix was read


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    from tests.helpers import finished_sft_run

    run, _ = finished_sft_run(tmp_path_factory.mktemp("calibration") / "run", tiny_models["llama"], stories, steps=1)
    return run


def test_calibration_texts_are_held_out_never_training_or_evaluation(sft_run):
    from slm_align.config import load_recipe
    from slm_align.config.from_sft import recipe_from_sft
    from slm_align.data.corpus import load_corpus
    from slm_align.export.converters.calibration import calibration_texts, plain_text

    recipe, _ = recipe_from_sft(sft_run, load_recipe(None, {}))
    splits = load_corpus(recipe.data, recipe.seed).splits
    used = {" ".join(plain_text(example).split()) for example in splits.train + splits.eval}
    texts = calibration_texts(sft_run)
    assert texts and not {" ".join(text.split()) for text in texts} & used
    assert texts == [plain_text(example) for example in splits.heldout][:len(texts)]


def test_calibrated_gguf_export_records_its_calibration(tmp_path, sft_run):
    metrics = run_export(ExportRequest(str(sft_run), "gguf", "Q4_0", out=tmp_path, calibrate=True,
                                       min_agreement=0.0)).metrics
    assert metrics["calibration_texts"] > 0 and (tmp_path / "model-Q4_0.gguf").is_file()


@pytest.mark.parametrize("target, quant", [("onnx", "w8"), ("gguf", "Q8_0")])
def test_calibrate_is_refused_where_nothing_takes_it(tmp_path, sft_run, target, quant):
    from slm_align.errors import UserError

    with pytest.raises(UserError, match="--calibrate"):
        run_export(ExportRequest(str(sft_run), target, quant, out=tmp_path / "out", calibrate=True))
    assert not (tmp_path / "out").exists()


def test_calibrate_needs_a_run(tmp_path, tiny_models):
    from slm_align.errors import UserError

    with pytest.raises(UserError, match="not a run directory"):
        run_export(ExportRequest(str(tiny_models["llama"]), "gguf", "Q4_0", out=tmp_path / "out", calibrate=True))
    assert not (tmp_path / "out").exists()
