"""A .gguf file is a model source: dequantized into a trainable model with its
tokenizer and chat template."""

import json
import shutil

import pytest
import torch

from slm_align.cli import main
from slm_align.errors import UserError
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.modeling.models import (
    load_model,
    load_tokenizer,
    resolve_source,
    save_tokenizer,
)
from slm_align.ondevice.gguf.fields import read_fields
from slm_align.ondevice.gguf.tokenizer import PROBE_TEXTS, SIDECAR
from slm_align.ondevice.gguf.writer import quantize_gguf, write_gguf
from tests.helpers import finished_sft_run

TEXTS = ["Once upon a time, there was a shy duck named Nina.",
         "<|im_start|>user\nhi<|im_end|>\n", " two  spaces"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip_keeps_logits_tokens_and_template(tmp_path, tiny_models, arch):
    path = write_gguf(tiny_models[arch], tmp_path / f"{arch}.gguf", "F32")
    hf_source, gguf_source = resolve_source(str(tiny_models[arch])), resolve_source(str(path))
    hf_tok, gguf_tok = load_tokenizer(hf_source), load_tokenizer(gguf_source)
    for text in TEXTS:
        assert gguf_tok(text)["input_ids"] == hf_tok(text)["input_ids"]
    assert gguf_tok.chat_template == hf_tok.chat_template and gguf_tok.eos_token == hf_tok.eos_token
    assert gguf_tok.pad_token == hf_tok.pad_token
    ids = torch.tensor([hf_tok(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        expected = load_model(hf_source)(ids).logits
        got = load_model(gguf_source)(ids).logits
    assert torch.allclose(got, expected, atol=1e-5)  # Llama's Q/K permutation was undone exactly


def test_sft_and_headroom_from_a_gguf_file(capsys, tmp_path, tiny_models, stories):
    path = write_gguf(tiny_models["llama"], tmp_path / "base.gguf", "F16")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["sft", "--model", str(path), "--data", str(stories), "--out", str(out), "--max-steps", "4",
              "--batch-size", "4", "--max-length", "64", "--json"])
    assert done.value.code == 0
    assert json.loads((out / "sft" / "manifest.json").read_text())["inputs"]["model"]["kind"] == "gguf"
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["check-headroom", "--run", str(out), "--max-ppl", "1e9", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert done.value.code == 0 and report["info"]["model"] == str(path)
    assert report["figures"][0]["value"] < report["info"]["base_ppl"]


def test_unsupported_gguf_export_is_a_user_error(tmp_path, tiny_models):
    model = tmp_path / "bert"
    shutil.copytree(tiny_models["llama"], model)
    (model / "config.json").write_text(json.dumps(dict(json.loads((model / "config.json").read_text()),
                                                       model_type="bert")))
    with pytest.raises(UserError, match="does not support architecture 'bert'"):
        write_gguf(model, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def tokenizer_fields(path) -> dict[str, bytes]:
    """Each tokenizer.* key/value of a .gguf as stored (key, type and value bytes)."""
    return {key: field.raw for key, field in read_fields(path).items()}


@pytest.fixture(scope="module")
def llama_cpp_made(tmp_path_factory, tiny_models):
    """The tiny Llama as a GGUF written by llama.cpp's quantizer (Q4_0), the way
    users get their files."""
    pytest.importorskip("llama_cpp")
    root = tmp_path_factory.mktemp("llama-cpp-made")
    full = write_gguf(tiny_models["llama"], root / "f32.gguf", "F32")
    return quantize_gguf(full, root / "base-Q4_0.gguf", "Q4_0")


def test_llama_cpp_gguf_loaded_saved_and_exported_keeps_its_tokenizer_fields(tmp_path, llama_cpp_made):
    source = resolve_source(str(llama_cpp_made))
    saved = tmp_path / "saved"
    load_model(source).save_pretrained(saved, safe_serialization=True)
    save_tokenizer(load_tokenizer(source), source, saved)
    assert (saved / SIDECAR).is_file()
    exported = write_gguf(saved, tmp_path / "out.gguf", "F32")
    assert tokenizer_fields(exported) == tokenizer_fields(llama_cpp_made)


def test_a_run_on_a_llama_cpp_gguf_exports_its_tokenizer_to_gguf_and_onnx(tmp_path, llama_cpp_made, stories):
    import llama_cpp
    from tokenizers import Tokenizer

    run, _ = finished_sft_run(tmp_path / "run", llama_cpp_made, stories, steps=2)
    exported = run_export(ExportRequest(str(run), "gguf", "Q8_0", out=tmp_path / "export"))
    assert exported.metrics["verification"]["tokenizer_match"] and exported.metrics["verification"]["passed"]
    assert tokenizer_fields(run / "merged" / SIDECAR) == tokenizer_fields(llama_cpp_made)
    assert tokenizer_fields(exported.stage_dir) == tokenizer_fields(llama_cpp_made)
    onnx = run_export(ExportRequest(str(run), "onnx", "fp32", out=tmp_path / "export"))
    assert onnx.metrics["verification"]["tokenizer_match"] and onnx.metrics["verification"]["passed"]
    llm = llama_cpp.Llama(str(llama_cpp_made), vocab_only=True, verbose=False)
    onnx_tokenizer = Tokenizer.from_file(str(onnx.stage_dir / "tokenizer.json"))
    for text in PROBE_TEXTS:
        assert onnx_tokenizer.encode(text).ids == llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)


@pytest.mark.slow
def test_real_gemma_gguf_saved_and_exported_keeps_its_tokenizer_fields(tmp_path, real_gemma_gguf):
    source = resolve_source(str(real_gemma_gguf))
    saved = tmp_path / "gemma"
    load_model(source).save_pretrained(saved, safe_serialization=True)
    save_tokenizer(load_tokenizer(source), source, saved)
    exported = write_gguf(saved, tmp_path / "gemma-F16.gguf", "F16")
    assert tokenizer_fields(exported) == tokenizer_fields(real_gemma_gguf)
