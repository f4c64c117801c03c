"""llama.cpp as the RL sampler: the base as a GGUF once, the current LoRA swapped in as an adapter GGUF
each iteration; its log-probabilities are the trainer's up to the engines' rounding, and a GRPO
iteration on them logs the mismatch and trains."""

import math

import pytest
import torch

from slm_align.envelope.logprobs import forward_logprobs
from slm_align.modeling.models import load_tokenizer, resolve_source
from slm_align.rl.llama_sampler import LlamaSampler
from tests.helpers import random_lora
from tests.rl.test_guards import lora_state, make_loop, sft_run  # noqa: F401

PROMPTS = ["Once upon a time"] * 3 + ["The cat sat"] * 3


def lora_policy(model_dir):
    """The tiny model under a LoRA whose B is not zero (its adapter moves the logits), with its source and
    tokenizer."""
    source = resolve_source(str(model_dir))
    return source, load_tokenizer(source), random_lora(model_dir, ["q_proj", "v_proj", "o_proj"])


def trainer_logprobs(policy, samples, adapter=True):
    ids = torch.cat([samples.prompt_ids, samples.completion_ids], 1)
    attention = torch.cat([samples.prompt_mask, samples.completion_mask], 1)
    with torch.no_grad():
        if adapter:
            return forward_logprobs(policy, ids, attention, samples.prompt_ids.shape[1], 1.0, None, False)[0]
        with policy.disable_adapter():
            return forward_logprobs(policy, ids, attention, samples.prompt_ids.shape[1], 1.0, None, False)[0]


def mean_gap(a, b, mask):
    return float(((a - b).abs() * mask).sum() / mask.sum())


@pytest.mark.parametrize("base_type, bound", [("F32", 1e-3), ("F16", 5e-3)])
def test_the_samplers_logprobs_are_the_trainers_with_the_adapter_swapped_in(tiny_models, tmp_path, base_type,
                                                                              bound):
    source, tokenizer, policy = lora_policy(tiny_models["llama"])
    sampler = LlamaSampler(policy, tokenizer, source, tmp_path, base_type, threads=1, n_ctx=256)
    try:
        sampler.refresh(policy)
        samples = sampler.sample(tokenizer, PROMPTS, 16, 1.0, seed=3)
        mask = samples.completion_mask.float()
        assert mask.sum() >= len(PROMPTS)
        gap = mean_gap(trainer_logprobs(policy, samples), samples.logprobs, mask)
        adapter_effect = mean_gap(trainer_logprobs(policy, samples, adapter=False), samples.logprobs, mask)
        assert gap < bound and adapter_effect > 20 * gap  # the adapter is on, and it is this policy's
        engine = sampler.llm
        for name, parameter in policy.named_parameters():  # the policy moves: the next refresh follows it
            if "lora_B" in name:
                parameter.data.mul_(-1)
        sampler.refresh(policy)
        again = sampler.sample(tokenizer, PROMPTS, 16, 1.0, seed=3)
        mask = again.completion_mask.float()
        assert sampler.llm is engine  # the base was not reloaded
        assert mean_gap(trainer_logprobs(policy, again), again.logprobs, mask) < bound
        assert samples.completions != again.completions
    finally:
        sampler.close()


def test_the_same_seed_draws_the_same_completions(tiny_models, tmp_path):
    source, tokenizer, policy = lora_policy(tiny_models["llama"])
    sampler = LlamaSampler(policy, tokenizer, source, tmp_path, "F32", threads=1, n_ctx=256)
    try:
        sampler.refresh(policy)
        first = sampler.sample(tokenizer, PROMPTS, 12, 1.0, seed=5)
        second = sampler.sample(tokenizer, PROMPTS, 12, 1.0, seed=5)
        assert first.completions == second.completions and torch.equal(first.completion_ids, second.completion_ids)
        assert len(set(first.completions[:3])) > 1  # a group's completions differ from each other
    finally:
        sampler.close()


def test_a_grpo_iteration_on_llama_cpp_rollouts_logs_the_mismatch_and_trains(sft_run, tmp_path):  # noqa: F811
    loop = make_loop(sft_run, sampler="llama_cpp", sampler_base="F32", epochs=1, minibatch_size=16)  # one step
    out, recipe = sft_run
    loop.sampler = LlamaSampler(loop.policy, loop.tokenizer, resolve_source(recipe.model.source), tmp_path, "F32",
                                threads=1, n_ctx=256)
    try:
        before = lora_state(loop)
        metrics = [loop.run_step(step) for step in range(2)]
    finally:
        loop.sampler.close()
    for figures in metrics:
        assert 0.0 <= figures["sampler/kl"] < 1e-4 and figures["sampler/capped_frac"] == 0.0
        assert figures["sampler/max_log_ratio"] < 0.05
        assert figures["time/sampler_sync"] > 0 and figures["time/sampling"] > 0
        assert figures["ratio/mean"] == pytest.approx(1.0, abs=1e-6)  # trainer against trainer: the first ratio is 1
    after = lora_state(loop)
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_train_with_the_llama_cpp_sampler_records_it_and_logs_the_mismatch(sft_run, capsys):  # noqa: F811
    import json
    import tempfile
    from pathlib import Path

    from slm_align.runs import read_manifest
    from tests.helpers import run_cli

    def sampler_folders():
        return set(Path(tempfile.gettempdir()).glob("slm-align-sampler-*"))

    out, _ = sft_run
    before = sampler_folders()
    code, _, err = run_cli(capsys, "train", "--algo", "grpo", "--out", out, "--force", "--steps", "2",
                           "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                           "--report-prompts", "0", "--set", "rl.sampler=llama_cpp", "--set", "rl.eval_prompts=2")
    assert code == 0, err
    manifest = read_manifest(out / "rl")
    assert manifest["inputs"]["rl"]["sampler"] == "llama_cpp" and manifest["inputs"]["rl"]["sampler_base"] == "source"
    lines = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(0.0 <= line["sampler/kl"] < 0.01 for line in lines)
    assert sampler_folders() == before  # the base GGUF and adapter files are removed with the stage


def test_draw_samples_the_softmax_and_returns_the_drawn_tokens_log_probability():
    from slm_align.rl.llama_sampler import draw

    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]]).repeat(40_000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = draw(logits, 0.5, generator)
    expected = torch.softmax(logits[0] / 0.5, -1)
    counts = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert torch.allclose(counts, expected, atol=0.01)  # the tempered distribution, not the raw one
    assert torch.allclose(logprobs, expected.log()[tokens].double(), atol=1e-6)


def uniform_at(u: float):
    """``torch.rand`` that returns ``u`` as a generator of the dtype asked for can: rounded to that dtype,
    and below 1 (a float32 uniform number stops at 1 - 6e-8)."""

    def rand(*size, dtype=None, device=None, generator=None):
        dtype = dtype or torch.float32
        below_one = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype))
        return torch.full(size, float(torch.minimum(torch.tensor(u, dtype=dtype), below_one)), dtype=dtype)

    return rand


@pytest.mark.parametrize("u, token", [(0.5, 0), (1 - 2e-9, 0), (1 - 5e-10, 1), (1 - 1e-12, 1)])
def test_a_tail_token_after_nearly_all_the_mass_is_drawn_at_its_uniform_numbers(monkeypatch, u, token):
    """p = (1 - 1e-9, 1e-9): the tail token owns the uniform numbers u in [1 - 1e-9, 1). A float32 running sum
    is 1.0 already at the first token and a float32 u never passes 1 - 6e-8: the tail token was never drawn."""
    from slm_align.rl.llama_sampler import draw

    tail = 1e-9
    logits = torch.tensor([[math.log1p(-tail), math.log(tail)]])
    monkeypatch.setattr(torch, "rand", uniform_at(u))
    tokens, logprobs = draw(logits, 1.0, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [token]
    assert logprobs[0].item() == pytest.approx(math.log([1 - tail, tail][token]), abs=1e-6)


def test_a_q4_k_m_base_is_quantized_and_its_mismatch_measured(tiny_models, tmp_path):
    """The base llama.cpp's quantizer makes (what a phone runs): its gap to the trainer is the quantization's,
    larger than F16's and smaller than the adapter's own effect."""
    from slm_align.ondevice.gguf.fields import read_fields

    source, tokenizer, policy = lora_policy(tiny_models["llama"])
    gaps = {}
    for base_type in ("F16", "Q4_K_M"):
        sampler = LlamaSampler(policy, tokenizer, source, tmp_path / base_type, base_type, threads=1, n_ctx=256)
        try:
            sampler.refresh(policy)
            samples = sampler.sample(tokenizer, PROMPTS, 16, 1.0, seed=3)
            mask = samples.completion_mask.float()
            gaps[base_type] = mean_gap(trainer_logprobs(policy, samples), samples.logprobs, mask)
            effect = mean_gap(trainer_logprobs(policy, samples, adapter=False), samples.logprobs, mask)
            file_type = read_fields(sampler.base_gguf, "general.file_type")["general.file_type"].value
        finally:
            sampler.close()
        assert file_type == {"F16": 1, "Q4_K_M": 15}[base_type]
    assert gaps["Q4_K_M"] > 3 * gaps["F16"] and gaps["Q4_K_M"] < effect / 2, (gaps, effect)


def test_a_sampler_that_cannot_run_is_refused_in_one_line_before_sft(tmp_path, tokenizer, tiny_models, stories,
                                                                       capsys, monkeypatch):
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import run_cli

    mistral = tmp_path / "mistral"
    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(mistral)
    tokenizer.save_pretrained(mistral)
    args = ["train", "--model", mistral, "--data", stories, "--out", tmp_path / "run", "--set", "rl.sampler=llama_cpp"]
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and "rl.sampler = llama_cpp: GGUF export does not support " \
        "architecture 'mistral'" in err and "rl.sampler = torch" in err, err
    assert not (tmp_path / "run" / "sft").exists() and not (tmp_path / "run" / "sft.partial").exists()
    found = importlib.util.find_spec

    def without_llama_cpp(name, *rest):
        return None if name == "llama_cpp" else found(name, *rest)

    monkeypatch.setattr(importlib.util, "find_spec", without_llama_cpp)
    code, _, err = run_cli(capsys, *args[:2], tiny_models["llama"], *args[3:])
    assert code == 2 and err.count("\n") == 1 and "needs llama-cpp-python" in err, err
    assert not (tmp_path / "run" / "sft").exists()


def test_a_gguf_source_samples_on_that_very_file_with_the_sft_adapter_first(llama_cpp_reference, tiny_models,
                                                                            tmp_path):
    """rl.sampler_base = "source" on a run from the user's GGUF (llama.cpp's converter made it): llama.cpp runs
    that file, untouched, with the SFT adapter and then the policy's; the trainer (SFT merged, LoRA on top)
    agrees, and would not without the SFT adapter in the chain."""
    import shutil

    from slm_align.config import RLSettings
    from slm_align.envelope.policy import build_policy
    from slm_align.runs import sha256_file
    from tests.helpers import save_lora

    users = shutil.copy(llama_cpp_reference["llama"], tmp_path / "users.gguf")
    before = sha256_file(users)
    sft = save_lora(tiny_models["llama"], tmp_path / "sft", ["q_proj", "v_proj"], seed=3)
    source = resolve_source(str(users))
    tokenizer = load_tokenizer(source)
    policies = {name: build_policy(source, adapter, RLSettings(), seed=0) for name, adapter in
                (("with sft", sft), ("without", None))}
    generator = torch.Generator().manual_seed(0)
    for name, parameter in policies["with sft"].named_parameters():
        if "lora_B" in name:
            parameter.data.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    lora = {name: tensor for name, tensor in policies["with sft"].state_dict().items() if "lora_" in name}
    policies["without"].load_state_dict(lora, strict=False)  # the same LoRA on the base without SFT
    sampler = LlamaSampler(policies["with sft"], tokenizer, source, tmp_path / "sampler", "source", threads=1,
                           n_ctx=256, sft_adapter=sft)
    try:
        sampler.refresh(policies["with sft"])
        samples = sampler.sample(tokenizer, PROMPTS, 16, 1.0, seed=3)
        assert sampler.base_gguf == users and len(sampler.chain) == 1
    finally:
        sampler.close()
    mask = samples.completion_mask.float()
    gap = mean_gap(trainer_logprobs(policies["with sft"], samples), samples.logprobs, mask)
    without = mean_gap(trainer_logprobs(policies["without"], samples), samples.logprobs, mask)
    assert gap < 1e-3 and without > 20 * gap, (gap, without)
    assert sha256_file(users) == before and sorted(p.name for p in (tmp_path / "sampler").iterdir()) == [
        "adapter", "adapter.gguf", "sft.gguf"]  # no base written: the user's file is the base
