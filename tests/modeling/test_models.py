import json
import shutil

import pytest
import torch

from slm_align.errors import UserError
from slm_align.modeling.models import (
    DEFAULT_MODEL_DIR,
    ensure_pad_token,
    load_model,
    load_tokenizer,
    lora_targets,
    resolve_source,
)
from tests.helpers import ARCHITECTURES


def test_sources_are_classified(tmp_path, tiny_models):
    assert resolve_source(None).ref == str(DEFAULT_MODEL_DIR)
    assert resolve_source(str(tiny_models["llama"])).kind == "dir"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)).kind == "gguf"
    assert resolve_source("HuggingFaceTB/SmolLM2-135M").kind == "hub"
    with pytest.raises(UserError, match="not found"):
        resolve_source("./missing-dir")
    with pytest.raises(UserError, match="not .gguf"):
        resolve_source(str(tiny_models["llama"] / "config.json"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_loads_in_float32(tiny_models, arch):
    source = resolve_source(str(tiny_models[arch]))
    model = load_model(source)
    tokenizer = load_tokenizer(source)
    assert model.config.model_type == arch
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tokenizer.pad_token is not None
    assert lora_targets(arch)  # every architecture has default LoRA targets


def test_pickle_checkpoints_are_refused_unless_opted_in(tmp_path, tiny_models):
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_models["llama"], pickled)
    model = load_model(resolve_source(str(pickled)))
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(UserError, match="pickle"):
        load_model(resolve_source(str(pickled)))
    assert load_model(resolve_source(str(pickled)), allow_pickle=True).config.model_type == "llama"


def test_unsupported_architecture_and_corrupt_weights(tmp_path, tiny_models):
    other = tmp_path / "other"
    shutil.copytree(tiny_models["llama"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(UserError, match="unsupported architecture 'bert'"):
        load_model(resolve_source(str(other)))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_models["llama"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot be loaded"):
        load_model(resolve_source(str(corrupt)))


def test_offline_hub_id_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load 'someone/some-model' "
                                        "from the Hugging Face Hub"):
        load_tokenizer(resolve_source("someone/some-model"))


def test_missing_pad_token_becomes_eos(tokenizer):
    from transformers import AutoTokenizer

    fresh = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    fresh.pad_token = None
    ensure_pad_token(fresh)
    assert fresh.pad_token == fresh.eos_token and len(fresh) == len(tokenizer)


def test_default_chat_template_speaks_gemma_to_a_gemma_vocabulary(tokenizer):
    import copy

    from slm_align.data.prompts import render_chat
    from slm_align.ondevice.templates.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE, default_chat_template

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    assert default_chat_template(plain) == CHATML_TEMPLATE
    gemma = copy.deepcopy(plain)
    gemma.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    assert default_chat_template(gemma) == GEMMA_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    text = render_chat(messages, gemma, add_generation_prompt=True)
    assert text == ("<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>model\n")
    assert gemma("<start_of_turn>user")["input_ids"][:1] == [gemma.convert_tokens_to_ids("<start_of_turn>")]


def test_a_gguf_source_loads_without_a_library_progress_bar_in_the_log(tmp_path, tiny_models, capfd):
    """transformers' GGUF loader drew a tqdm bar of its own ("Converting and de-quantizing GGUF tensors...")
    into stderr, which a log (not a terminal) got as carriage-return lines."""
    from transformers import modeling_gguf_pytorch_utils

    from slm_align.ondevice.gguf.writer import write_gguf

    drawn = modeling_gguf_pytorch_utils.tqdm
    gguf = write_gguf(tiny_models["llama"], tmp_path / "tiny-F32.gguf", "F32")
    capfd.readouterr()
    model = load_model(resolve_source(str(gguf)))
    err = capfd.readouterr().err
    assert model.config.model_type == "llama"
    assert "GGUF tensors" not in err and "\r" not in err and "it/s" not in err
    assert modeling_gguf_pytorch_utils.tqdm is drawn  # the loader's own bar is back for other callers
