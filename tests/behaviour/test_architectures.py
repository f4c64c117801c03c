"""Today's small architectures (Qwen3, Gemma 3 text, GPT-2 export) everywhere a model goes.

The reference for GGUF is llama.cpp itself twice over: its runtime computes the logits, and its own
converter (tests/llama_cpp_reference.py) writes the file ours must equal. PyTorch is the reference
for what the logits should be.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from slm_align.errors import UserError
from slm_align.export.publishing.parity import HELDOUT_TEXT
from slm_align.modeling.models import (
    build_tiny_model,
    load_model,
    load_tokenizer,
    lora_targets,
    resolve_source,
)
from slm_align.ondevice.gguf.writer import write_gguf
from tests.helpers import ARCHITECTURES, run_cli

pytest.importorskip("llama_cpp")

NEW = ["qwen3", "gemma3_text"]
PROBE = 64  # tokens; Gemma's tiny sliding window is 8


def _probe_ids(tokenizer) -> list[int]:
    return tokenizer(HELDOUT_TEXT)["input_ids"][:PROBE]


def _torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _llama_cpp_logits(path, ids) -> np.ndarray:
    from slm_align.ondevice.agent.open_artifact import open_backend

    return open_backend(path, all_logits=True).feed_all(ids)


def _gguf_tensors(path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    return {tensor.name: np.array(tensor.data) for tensor in GGUFReader(str(path)).tensors}


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _edited_copy(model_dir, destination, **changes):
    shutil.copytree(model_dir, destination)
    (destination / "config.json").write_text(json.dumps(dict(_config(model_dir), **changes)))
    return destination


def test_tiny_models_have_the_features_under_test(tiny_models):
    gemma, qwen3 = _config(tiny_models["gemma3_text"]), _config(tiny_models["qwen3"])
    assert gemma["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's pattern
    assert gemma["sliding_window"] == 8
    tied = load_model(resolve_source(str(tiny_models["gemma3_text"])))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    for config in (gemma, qwen3):
        assert config["head_dim"] == 16 != config["hidden_size"] // config["num_attention_heads"]
    names = set(load_model(resolve_source(str(tiny_models["qwen3"]))).state_dict())
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names
    assert not any("q_proj.bias" in name for name in names)  # Qwen3: no qkv bias
    assert lora_targets("gemma3_text") == lora_targets("qwen3") == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_the_probe_reaches_past_gemmas_sliding_window(tiny_models, tokenizer):
    """Without this, a runtime that ignored the window would pass every comparison below."""
    ids = _probe_ids(tokenizer)
    windowed = load_model(resolve_source(str(tiny_models["gemma3_text"])))
    wide = build_tiny_model("gemma3_text", len(tokenizer))
    wide.config.sliding_window = PROBE * 2
    expected, unwindowed = _torch_logits(windowed, ids), _torch_logits(wide, ids)
    assert len(ids) == PROBE
    assert np.array_equal(expected[:8], unwindowed[:8])  # inside the window the two agree exactly
    assert np.abs(expected[8:] - unwindowed[8:]).max() > 1e-3


def _token_types(path) -> list[int]:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.token_type"]
    return [int(field.parts[index][0]) for index in field.data]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_our_gguf_equals_llama_cpps_converter(tmp_path, tiny_models, llama_cpp_reference, tokenizer, arch):
    ours = write_gguf(tiny_models[arch], tmp_path / "ours.gguf", "F32")
    theirs = llama_cpp_reference[arch]
    ours_tensors, their_tensors = _gguf_tensors(ours), _gguf_tensors(theirs)
    assert ours_tensors.keys() == their_tensors.keys()
    for name, tensor in their_tensors.items():
        assert np.array_equal(ours_tensors[name], tensor), name
    # token types too: the bundled tokenizer's <tool_call> is added but not special (USER_DEFINED in both)
    assert _token_types(ours) == _token_types(theirs)
    ids = _probe_ids(tokenizer)
    assert np.array_equal(_llama_cpp_logits(ours, ids), _llama_cpp_logits(theirs, ids))


@pytest.mark.parametrize("arch", NEW + ["gpt2"])
def test_our_q8_0_equals_llama_cpps_converters(tmp_path, tiny_models, arch):
    from tests.llama_cpp_reference import convert

    ours = _gguf_tensors(write_gguf(tiny_models[arch], tmp_path / "ours.gguf", "Q8_0"))
    theirs = _gguf_tensors(convert(tiny_models[arch], tmp_path / "theirs.gguf", "q8_0"))
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[name], theirs[name]) for name in theirs)


@pytest.mark.parametrize("arch", NEW + ["gpt2"])
def test_llama_cpp_computes_pytorchs_logits_from_our_file(tmp_path, tiny_models, tokenizer, arch):
    ids = _probe_ids(tokenizer)
    expected = _torch_logits(load_model(resolve_source(str(tiny_models[arch]))), ids)
    got = _llama_cpp_logits(write_gguf(tiny_models[arch], tmp_path / "m.gguf", "F32"), ids)
    assert np.abs(got - expected).max() < 2e-3 * np.abs(expected).max()
    assert np.array_equal(got.argmax(-1), expected.argmax(-1))


def test_gemma_norms_gain_one_and_gpt2_conv1d_weights_are_transposed(tmp_path, tiny_models):
    from safetensors.numpy import load_file

    gemma = load_file(tiny_models["gemma3_text"] / "model.safetensors")
    written = _gguf_tensors(write_gguf(tiny_models["gemma3_text"], tmp_path / "g.gguf", "F32"))
    for hf_name, gguf_name in (("model.norm.weight", "output_norm.weight"),
                               ("model.layers.5.self_attn.q_norm.weight", "blk.5.attn_q_norm.weight"),
                               ("model.layers.0.post_feedforward_layernorm.weight", "blk.0.post_ffw_norm.weight")):
        assert np.array_equal(written[gguf_name], gemma[hf_name] + np.float32(1.0))
    assert "output.weight" not in written  # tied: llama.cpp reuses token_embd
    gpt2 = load_file(tiny_models["gpt2"] / "model.safetensors")
    written = _gguf_tensors(write_gguf(tiny_models["gpt2"], tmp_path / "g2.gguf", "F32"))
    assert np.array_equal(written["blk.0.attn_qkv.weight"], gpt2["transformer.h.0.attn.c_attn.weight"].T)
    assert np.array_equal(written["position_embd.weight"], gpt2["transformer.wpe.weight"])
    assert np.array_equal(written["output_norm.bias"], gpt2["transformer.ln_f.bias"])


@pytest.mark.parametrize("arch", NEW + ["gpt2"])
def test_a_gguf_of_ours_loads_back_into_pytorch_exactly(tmp_path, tiny_models, tokenizer, arch):
    """transformers' GGUF loader misses Qwen3's head_dim, Gemma's attention scale and GPT-2's
    context length; load_model reads them from the file."""
    path = write_gguf(tiny_models[arch], tmp_path / "m.gguf", "F32")
    ids = _probe_ids(tokenizer)
    expected = _torch_logits(load_model(resolve_source(str(tiny_models[arch]))), ids)
    reloaded = load_model(resolve_source(str(path)))
    assert reloaded.config.model_type == arch
    assert np.abs(_torch_logits(reloaded, ids) - expected).max() < 1e-5


@pytest.mark.parametrize("arch", NEW)
def test_a_gguf_made_by_llama_cpp_loads_into_pytorch(tiny_models, llama_cpp_reference, tokenizer, arch):
    ids = _probe_ids(tokenizer)
    expected = _torch_logits(load_model(resolve_source(str(tiny_models[arch]))), ids)
    reloaded = load_model(resolve_source(str(llama_cpp_reference[arch])))
    assert np.abs(_torch_logits(reloaded, ids) - expected).max() < 1e-5


@pytest.mark.parametrize("changes, problem", [
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 5}, "every 6th layer global"),
    ({"query_pre_attn_scalar": 64}, "query_pre_attn_scalar"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_a_gemma_that_llama_cpp_would_run_differently_is_refused_in_one_line(capsys, tmp_path, tiny_models,
                                                                            changes, problem):
    model = _edited_copy(tiny_models["gemma3_text"], tmp_path / "gemma", **changes)
    with pytest.raises(UserError, match=problem):
        write_gguf(model, tmp_path / "x.gguf")
    code, out, err = run_cli(capsys, "export", model, "--target", "gguf", "--out", tmp_path / "out")
    assert code == 2 and out == "" and err.count("\n") == 1 and "export to ONNX instead" in err
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "out").exists()


def test_gemmas_local_rope_base_is_written_for_llama_cpp(tmp_path, tiny_models, tokenizer):
    model = _edited_copy(tiny_models["gemma3_text"], tmp_path / "gemma", rope_local_base_freq=500.0)
    ids = _probe_ids(tokenizer)
    expected = _torch_logits(load_model(resolve_source(str(model))), ids)
    default = _torch_logits(load_model(resolve_source(str(tiny_models["gemma3_text"]))), ids)
    got = _llama_cpp_logits(write_gguf(model, tmp_path / "g.gguf", "F32"), ids)
    assert np.abs(expected - default).max() > 1e-3  # the base changes the model
    assert np.abs(got - expected).max() < 2e-3 * np.abs(expected).max()


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, tiny_models, stories):
    """For each new architecture: SFT, reward model and one PPO iteration from the command line."""
    from slm_align.cli import main

    runs = {}
    for arch in NEW:
        root = tmp_path_factory.mktemp(arch)
        recipe = root / "recipe.toml"
        recipe.write_text('[data]\nmax_length = 64\n[sft]\nmax_steps = 2\nbatch_size = '
                          '4\n[reward]\nmax_steps = 2\nbatch_size = 4\n[rl]\nsteps = '
                          '1\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = '
                          '8\neval_prompts = 2\nreport_prompts = 4\n'
                          # the watchdog publishes its peak probe, on a random tiny model often step 0's
                          # untrained adapter: off here, the last step's adapter shows the update reached LoRA
                          '[rl.watchdog]\nenabled = false\n[headroom]\nmax_documents = '
                          '8\nspread_prompts = 2\nmax_new_tokens = 8\n')
        with pytest.raises(SystemExit) as done:
            main(["train", "--algo", "ppo", "--model", str(tiny_models[arch]), "--data", str(stories), "--out",
                  str(root / "run"), "--config", str(recipe), "--force", "--json"])
        assert done.value.code == 0
        runs[arch] = root / "run"
    return runs


@pytest.mark.parametrize("arch", NEW)
def test_sft_reward_and_ppo_train_the_new_architectures(trained_runs, arch):
    from safetensors.torch import load_file

    run = trained_runs[arch]
    for stage in ("sft", "reward", "rl"):
        assert json.loads((run / stage / "manifest.json").read_text())["stage"] == stage
    rl_adapter = load_file(run / "rl" / "adapter" / "adapter_model.safetensors")
    targets = {name.split(".")[-3] for name in rl_adapter if "lora_B" in name}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert any(tensor.abs().sum() > 0 for name, tensor in rl_adapter.items() if "lora_B" in name)


@pytest.mark.parametrize("arch", NEW)
def test_a_trained_run_merges_exports_and_chats_on_both_runtimes(capsys, trained_runs, arch):
    from slm_align.ondevice.agent.runtime import Agent
    from slm_align.ondevice.agent.settings import SamplingParams

    run = trained_runs[arch]
    artifacts = {}
    for target, quant in (("gguf", "F32"), ("onnx", "fp32")):
        code, out, err = run_cli(capsys, "export", run, "--target", target, "--quant", quant, "--json")
        assert code == 0, err
        check = json.loads(out)["metrics"]["verification"]
        # every prompt decodes as PyTorch does, or parts at a recorded near-tie (float noise, gap < 1e-4)
        assert check["passed"] and check["agreement"] == 1.0 and not check["divergences"], json.dumps(check)
        assert check["greedy_exact"] + len(check["ties"]) == check["prompts"] == 4
        assert all(tie["torch_logit_gap"] < 1e-4 for tie in check["ties"])
        artifacts[target] = json.loads(out)["dir"]
    merged = load_model(resolve_source(str(run / "merged")))
    assert merged.config.model_type == arch and json.loads((run / "merged" / "manifest.json").read_text())
    tokenizer = load_tokenizer(resolve_source(str(run / "merged")))
    ids = _probe_ids(tokenizer)
    assert np.array_equal(_llama_cpp_logits(artifacts["gguf"], ids).argmax(-1), _torch_logits(merged, ids).argmax(-1))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    replies = [Agent.load(artifacts[target], sampling=greedy).chat("Tell me a story.").text for target in artifacts]
    assert replies[0] == replies[1] and replies[0]


@pytest.mark.slow
def test_the_real_gemma_3_270m_gguf_loads_into_pytorch_as_llama_cpp_runs_it(real_gemma_gguf):
    """llama.cpp's own Q4_K_M file: transformers dequantizes it (norms minus one, head_dim 256,
    window 512); PyTorch and llama.cpp then pick the same next token almost everywhere (llama.cpp
    also rounds activations)."""
    from slm_align.ondevice.agent.open_artifact import open_backend

    backend = open_backend(real_gemma_gguf, all_logits=True, n_ctx=1024)
    ids = backend.tokenize(HELDOUT_TEXT)
    theirs = backend.feed_all(ids)
    model = load_model(resolve_source(str(real_gemma_gguf)))
    assert (model.config.head_dim, model.config.query_pre_attn_scalar, model.config.sliding_window) == (256, 256, 512)
    assert (_torch_logits(model, ids).argmax(-1) == theirs.argmax(-1)).mean() >= 0.9
