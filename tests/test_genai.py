"""onnxruntime-genai folders (issue 23, item 1): our ONNX export plus genai_config.json loads in onnxruntime-genai's
Python API, tokenizes as our tokenizer does, and decodes greedily as PyTorch does (fp32: exactly)."""

import json

import pytest

from slm_align.agent.sampling import SamplingParams
from slm_align.errors import UserError
from slm_align.export.genai import genai_config, genai_greedy, genai_tokens, write_genai_config
from slm_align.export.stage import ExportRequest, run_export

og = pytest.importorskip("onnxruntime_genai")
PROMPTS = ["Once upon a time", "The fox went to the river and"]
NEW_TOKENS = 24


def torch_greedy(model_dir, prompt_ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_genai_folder_tokenizes_and_decodes_greedily_as_pytorch(tiny_models, tmp_path, arch):
    from transformers import AutoTokenizer

    folder = run_export(ExportRequest(str(tiny_models[arch]), "onnx", "fp32", out=tmp_path)).stage_dir
    write_genai_config(folder, SamplingParams(temperature=0).to_dict())
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert genai_tokens(folder, prompt) == ids
        genai = genai_greedy(folder, ids, NEW_TOKENS)
        assert genai == torch_greedy(tiny_models[arch], ids)[:len(genai)] and len(genai) >= 1


def test_the_config_carries_the_sampling_defaults_and_refuses_other_architectures():
    config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2,
              "num_hidden_layers": 1, "eos_token_id": [3, 4], "max_position_embeddings": 64}
    written = genai_config(config, SamplingParams().to_dict())
    assert written["search"]["do_sample"] and written["search"]["top_k"] == 40
    assert written["model"]["eos_token_id"] == written["model"]["pad_token_id"] == 3
    assert written["model"]["decoder"]["head_size"] == 4
    json.dumps(written)
    with pytest.raises(UserError, match="gpt_neox is not supported"):
        genai_config(dict(config, model_type="gpt_neox"), SamplingParams().to_dict())
