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


def plain_card(run, name, stage) -> str:
    return f"# {name}\n"


def test_a_merge_is_reused_by_its_inputs_hash_not_by_file_times(tmp_path, tiny_models, stories, monkeypatch):
    """Touching the stages' files keeps the merge; a stage made again (another identity) redoes it."""
    import os
    import time

    from slm_align.export.converters import merge
    from slm_align.export.converters.merge import current_merged
    from slm_align.runs import make_manifest, publish
    from tests.helpers import finished_rl_stage

    def record_rl(inputs: dict) -> None:
        publish(run / "rl", run / "rl-again", make_manifest("rl", inputs, {}, time.time()))
        (run / "rl-again").rename(run / "rl")

    monkeypatch.setattr(merge, "merged_card", plain_card)  # the card reads RL figures this stage lacks
    run, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    finished_rl_stage(run)
    record_rl({"round": 1})
    merged = current_merged(run)
    first = json.loads((merged / "manifest.json").read_text())
    later = (merged / "manifest.json").stat().st_mtime_ns + 10**10
    for path in [*(run / "rl").rglob("*"), *(run / "sft").rglob("*")]:
        os.utime(path, ns=(later, later))  # newer than the merge: the old rule merged again
    assert current_merged(run) == merged
    assert json.loads((merged / "manifest.json").read_text()) == first  # reused as it is
    record_rl({"round": 2})  # the same adapter, recorded as another stage
    current_merged(run)
    again = json.loads((merged / "manifest.json").read_text())
    assert again["inputs_hash"] != first["inputs_hash"]
    assert again["inputs"]["policy"]["rl"] != first["inputs"]["policy"]["rl"]
    assert again["inputs"]["policy"]["sft"] == first["inputs"]["policy"]["sft"]
