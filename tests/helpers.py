"""Helpers the test modules share (fixtures stay in conftest.py): running the CLI in-process, a
finished SFT run, the bundled model exported, a digest of a directory tree."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.agent.store_schema import MIGRATIONS

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3_text", "gpt_neox", "gpt2"]


def export_bundled(out: Path, *kinds: tuple[str, str]) -> dict[str, Path]:
    """The bundled model exported without verification (fast) as each ``(target,
    quant)``, keyed by target."""
    from slm_align.export.publishing.stage import ExportRequest, run_export

    return {target: run_export(ExportRequest(str(DEFAULT_MODEL_DIR), target, quant, out=out, verify=False)).stage_dir
            for target, quant in kinds}


def run_cli(capsys, *args):
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    from slm_align.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def finished_sft_run(out: Path, model_dir: Path, corpus: Path, steps: int):
    """A run directory whose SFT stage finished after ``steps`` steps, and its recipe."""
    from slm_align.config import load_recipe
    from slm_align.sft.stage import run_sft

    recipe = load_recipe(overrides={"model.source": str(model_dir), "data.path": str(corpus),
                                    "sft.max_steps": steps, "sft.batch_size": 4, "data.max_length": 96})
    run_sft(recipe, out)
    return out, recipe


def finished_rl_stage(run: Path) -> None:
    """An RL stage's adapter as train publishes it (a LoRA on the merged SFT prior whose B matrices
    moved), with an empty manifest: for what reads the adapter, not RL's metrics."""
    import time

    import torch

    from slm_align.config import LoraSettings, load_recipe
    from slm_align.config.from_sft import recipe_from_sft
    from slm_align.modeling.models import attach_lora, merged_policy, resolve_source, save_adapter
    from slm_align.runs import make_manifest, partial_dir, publish

    recipe, sft = recipe_from_sft(run, load_recipe())
    policy = attach_lora(merged_policy(resolve_source(recipe.model.source), sft), LoraSettings(r=4), seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    partial = partial_dir(run / "rl")
    save_adapter(policy, partial / "adapter")
    publish(partial, run / "rl", make_manifest("rl", {}, {}, time.time()))


def tree_digest(path: Path) -> str:
    """sha256 over every file's relative path and bytes below ``path`` (equal
    digests: nothing changed)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return digest.hexdigest()


def torch_greedy(model_dir, prompt_ids, new_tokens: int, stop_at_eos: bool = False):
    """PyTorch's greedy continuation of ``prompt_ids`` by the fp32 model in ``model_dir``: exactly
    ``new_tokens`` tokens (the reference the mobile runtimes' greedy decoding must match), or with
    ``stop_at_eos`` at most that many, ending at the first end-of-sequence token (which is kept)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    least = 0 if stop_at_eos else new_tokens
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=least, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def policy_with_moved_lora(path, rl, scale: float, seed: int):
    """The RL policy of the model at ``path`` with its LoRA B matrices drawn at ``scale``
    (seeded), as after some updates: the adapter then changes the log-probabilities (and LoRA
    dropout would matter)."""
    import torch

    from slm_align.envelope.policy import build_policy
    from slm_align.modeling.models import resolve_source

    policy = build_policy(resolve_source(str(path)), None, rl, seed=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    return policy


def most_repeated_name(text: str) -> str:
    """The capitalised word ``text`` repeats most (a story's hero)."""
    words = [word.strip(".,!?") for word in text.split()]
    return max((w for w in words if w[:1].isupper()), key=words.count)


def stepwise_agreement(artifact: Path, model_dir: Path) -> tuple[float, int]:
    """(top-1 agreement, positions) of an exported artifact with its PyTorch source over the verification's
    held-out text, recomputed here another way than the exporter does: the artifact fed one token at a time from a
    fresh cache, PyTorch's logits from transformers' own loader. An export's reported agreement must equal it."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slm_align.export.publishing.parity import HELDOUT_TEXT
    from slm_align.ondevice.agent.open_artifact import open_backend

    backend = open_backend(artifact)
    ids = AutoTokenizer.from_pretrained(model_dir)(HELDOUT_TEXT)["input_ids"][: backend.n_ctx]
    backend.reset()
    artifact_top1 = [int(np.argmax(backend.feed([token]))) for token in ids]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch_top1 = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
    return sum(a == b for a, b in zip(artifact_top1, torch_top1)) / len(ids), len(ids)


def random_lora(model_dir, targets, seed: int = 0, **settings):
    """A peft LoRA on ``targets`` of the model in ``model_dir`` (fp32), every A and B drawn at std 0.1
    (the delta is then as large as the weights: it changes what the model says)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    settings = {"r": 4, "lora_alpha": 8, **settings}
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, init_lora_weights=False,
                                                  fan_in_fan_out=model.config.model_type == "gpt2", **settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return peft_model.eval()


def save_lora(model_dir, out, targets, seed: int = 0, **settings):
    """:func:`random_lora` saved to ``out`` (adapter_config.json + adapter_model.safetensors); ``out``."""
    random_lora(model_dir, targets, seed, **settings).save_pretrained(out)
    return out


def decisive_models(root, tokenizer, architectures) -> dict:
    """Tiny models whose output head is scaled up 60x, saved under ``root`` by architecture: a random
    model at init std 0.02 has near-tied logits, where rounding to F16 may legitimately flip a greedy
    choice; these make every choice clear. ``{architecture: directory}``."""
    import torch

    from slm_align.modeling.models import build_tiny_model

    folders = {}
    for arch in architectures:
        model = build_tiny_model(arch, vocab_size=len(tokenizer))
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(60.0)
        model.save_pretrained(root / arch, safe_serialization=True)
        tokenizer.save_pretrained(root / arch)
        folders[arch] = root / arch
    return folders


def old_store(path: Path, version: int, model_id: str, messages: str = "[]",
              completion: str = "x") -> None:
    """A preference store at schema ``version`` (as an older slm-align or app left it) holding one
    consented turn, id 1."""
    conn = sqlite3.connect(path, isolation_level=None)
    for number, script in enumerate(MIGRATIONS[:version], start=1):
        conn.executescript(script)
        conn.execute(f"PRAGMA user_version = {number}")
    conn.execute("INSERT INTO turns (conversation_id, created_at, model_id, messages, completion, "
                 "sampling, consent, token) VALUES ('c', '2026-01-01T00:00:00.000+00:00', ?, ?, ?, "
                 "'{}', 1, 't')", (model_id, messages, completion))
    conn.close()
