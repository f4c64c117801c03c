"""A .gguf source is dequantized once into a cached HF directory keyed by its content."""

import pytest
import torch

from slm_align.modeling.models import gguf_directory, load_model, load_tokenizer, resolve_source
from slm_align.ondevice.gguf import cache as gguf_cache
from slm_align.ondevice.gguf.tokenizer import PROBE_TEXTS, load_gguf_tokenizer
from slm_align.ondevice.gguf.writer import write_gguf


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(root))
    return root


@pytest.fixture()
def tiny_gguf(tmp_path, tiny_models):
    return write_gguf(tiny_models["llama"], tmp_path / "tiny.gguf", "F32")


def test_second_load_reads_the_cache_without_dequantizing(cache, tiny_gguf, monkeypatch):
    source = resolve_source(str(tiny_gguf))
    first = load_model(source)
    assert [entry.name for entry in (cache / "gguf").iterdir()] == [gguf_cache.file_sha256(tiny_gguf)]

    def refuse(path):
        raise AssertionError("the .gguf file was read again")

    monkeypatch.setattr("slm_align.ondevice.gguf.tokenizer.load_gguf_tokenizer", refuse)  # read first
    second = load_model(source)
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_cache_entry_follows_the_bytes_not_the_name(cache, tiny_gguf, tmp_path, tiny_models):
    first = gguf_directory(resolve_source(str(tiny_gguf)))
    write_gguf(tiny_models["qwen2"], tiny_gguf, "F32")  # same path, other model
    second = gguf_directory(resolve_source(str(tiny_gguf)))
    assert first.ref != second.ref
    assert load_model(resolve_source(str(tiny_gguf))).config.model_type == "qwen2"


def test_cached_tokenizer_equals_the_verified_one(cache, tiny_gguf):
    built = load_gguf_tokenizer(tiny_gguf)
    cached = load_tokenizer(resolve_source(str(tiny_gguf)))
    for text in PROBE_TEXTS:
        assert cached(text)["input_ids"] == built(text)["input_ids"]
    assert (cached.bos_token, cached.eos_token, cached.chat_template) == (built.bos_token, built.eos_token,
                                                                         built.chat_template)


class _CrashingModel:
    """Writes one file of its checkpoint, then dies (a kill or a full disk mid-save)."""

    def save_pretrained(self, directory, **_):
        directory.mkdir(parents=True, exist_ok=True)  # as save_pretrained does
        (directory / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt


def test_an_interrupted_first_load_leaves_no_entry(cache, tiny_gguf):
    def model():
        return _CrashingModel()

    def tokenizer():
        return load_gguf_tokenizer(tiny_gguf)

    def save(tok, directory):
        tok.save_pretrained(directory)

    with pytest.raises(KeyboardInterrupt):
        gguf_cache.materialize(tiny_gguf, model, tokenizer, save)
    assert list((cache / "gguf").iterdir()) == []
    assert gguf_directory(resolve_source(str(tiny_gguf))).ref == str(gguf_cache.cached_dir(tiny_gguf))
