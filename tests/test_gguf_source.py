"""A .gguf file is a model source: dequantized into a trainable model with its tokenizer and chat template."""

import json

import pytest
import torch

from slm_align.cli import main
from slm_align.errors import UserError
from slm_align.export.gguf import write_gguf
from slm_align.modeling import load_model, load_tokenizer, resolve_source

TEXTS = ["Once upon a time, there was a shy duck named Nina.", "<|im_start|>user\nhi<|im_end|>\n", " two  spaces"]


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
    with pytest.raises(UserError, match="does not support architecture 'gpt2'"):
        write_gguf(tiny_models["gpt2"], tmp_path / "x.gguf")
    assert not any(tmp_path.iterdir())
