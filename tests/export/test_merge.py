"""merge folds SFT and RL adapters into a plain checkpoint with the same outputs
as the adapted policy."""

import json

import pytest
import torch

from slm_align.cli import main
from slm_align.modeling.models import merged_policy, resolve_source
from slm_align.pipeline import run_rl
from tests.helpers import finished_sft_run


def test_merged_checkpoint_loads_without_peft_and_matches_the_policy(capsys, tmp_path, tiny_models, stories):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, recipe = finished_sft_run(tmp_path / "run", tiny_models["gpt_neox"], stories, steps=2)
    small = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_prompts=2, algo="grpo")
    run_rl(recipe.model_copy(update={"rl": recipe.rl.model_copy(update=small)}), out, rewards=["length_window"],
           force=True)
    with pytest.raises(SystemExit) as done:
        main(["merge", "--run", str(out), "--json"])
    summary = json.loads(capsys.readouterr().out)
    merged_dir = out / "merged"
    assert done.value.code == 0 and summary["dir"] == str(merged_dir)
    assert not list(merged_dir.glob("adapter*")) and (merged_dir / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not hasattr(merged, "peft_config")
    policy = PeftModel.from_pretrained(merged_policy(resolve_source(recipe.model.source), out / "sft" / "adapter"),
                                       str(out / "rl" / "adapter")).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, policy(ids).logits, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert tokenizer.chat_template and merged.generation_config.eos_token_id == tokenizer.eos_token_id
    manifest = json.loads((merged_dir / "manifest.json").read_text())
    assert manifest["inputs"]["aligned_adapter"].endswith("rl/adapter") and manifest["inputs"]["aligned_stage"] == "rl"
    before = (merged_dir / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as again:
        main(["merge", "--run", str(out)])
    assert again.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert (merged_dir / "model.safetensors").read_bytes() == before
