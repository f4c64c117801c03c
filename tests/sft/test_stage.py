import json

import pytest
from safetensors.torch import load_file

from slm_align.config import load_recipe
from slm_align.errors import UserError
from slm_align.headroom.stage import check_headroom
from slm_align.sft.stage import run_sft
from tests.helpers import ARCHITECTURES, tree_digest


def recipe_for(model_dir, stories, **extra):
    overrides = {"model.source": str(model_dir), "data.path": str(stories), "sft.max_steps": 4,
                 "sft.batch_size": 4, "sft.save_steps": 2, "data.max_length": 64, "sft.lora.r": 4}
    return load_recipe(overrides=dict(overrides, **extra))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sft_trains_lora_only_and_writes_a_complete_stage(tmp_path, tiny_models, stories, arch):
    recipe = recipe_for(tiny_models[arch], stories)
    base_before = tree_digest(tiny_models[arch])
    result = run_sft(recipe, tmp_path)
    stage = tmp_path / "sft"
    assert not result.skipped and result.metrics["steps"] == 4
    assert sorted(p.name for p in stage.iterdir()) == ["adapter", "inputs.json", "log.jsonl", "manifest.json",
                                                       "tokenizer"]
    assert not (tmp_path / "sft.partial").exists()
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["inputs"]["sft"]["neftune_alpha"] == 5.0 and manifest["versions"]["torch"]
    assert len(manifest["inputs"]["data"]) == 64  # sha256 of the corpus file
    adapter = load_file(stage / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: every B moved
    report = check_headroom(load_recipe(overrides={"headroom.max_ppl": 1e9}), run=tmp_path).to_dict()
    assert report["verdict"] == "PASS" and report["info"]["eval_tokens"] > 0
    assert report["figures"][0]["value"] < report["info"]["base_ppl"]  # even 4 steps lower held-out perplexity
    assert tree_digest(tiny_models[arch]) == base_before  # the base checkpoint is untouched, byte for byte


def test_same_inputs_are_skipped_and_other_inputs_refused(tmp_path, tiny_models, stories):
    recipe = recipe_for(tiny_models["llama"], stories)
    run_sft(recipe, tmp_path)
    before = (tmp_path / "sft" / "manifest.json").read_bytes()
    assert run_sft(recipe, tmp_path).skipped
    with pytest.raises(UserError, match="other inputs"):
        run_sft(recipe_for(tiny_models["llama"], stories, **{"sft.learning_rate": 1e-4}), tmp_path)
    assert (tmp_path / "sft" / "manifest.json").read_bytes() == before
    moved = tmp_path / "elsewhere" / stories.name  # the same file in another folder: the same inputs
    moved.parent.mkdir()
    moved.write_bytes(stories.read_bytes())
    assert run_sft(recipe_for(tiny_models["llama"], moved, **{"data.tasks": str(moved)}), tmp_path).skipped
    moved.write_text(moved.read_text() + "One more story.\n")  # other bytes: other inputs
    with pytest.raises(UserError, match="other inputs"):
        run_sft(recipe_for(tiny_models["llama"], moved), tmp_path)


def test_interrupted_sft_resumes_from_its_checkpoint(tmp_path, tiny_models, stories, monkeypatch):
    from slm_align.envelope import trainer as training

    recipe = recipe_for(tiny_models["llama"], stories)
    original = training.TrainerProgress.on_step_end

    def crash_at_three(self, args, state, control, **kwargs):
        original(self, args, state, control, **kwargs)
        if state.global_step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(training.TrainerProgress, "on_step_end", crash_at_three)
    with pytest.raises(KeyboardInterrupt):
        run_sft(recipe, tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / "sft").exists() and (tmp_path / "sft.partial" / "checkpoints" / "checkpoint-2").is_dir()
    with pytest.raises(UserError, match="--resume"):
        run_sft(recipe, tmp_path)
    result = run_sft(recipe, tmp_path, resume=True)
    assert result.metrics["resumed_from"].endswith("checkpoint-2") and result.metrics["steps"] == 4


def test_headroom_reports_sft_and_base_perplexity(tmp_path, tiny_models, stories):
    recipe = recipe_for(tiny_models["qwen2"], stories, **{"sft.max_steps": 6})
    run_sft(recipe, tmp_path)
    report = check_headroom(load_recipe(overrides={"headroom.max_ppl": 1e9}), run=tmp_path)
    saved = report.to_dict()
    assert report.passed and saved["verdict"] == "PASS"
    assert saved["info"]["base_ppl"] > saved["figures"][0]["value"]  # SFT lowered held-out perplexity
    assert not (tmp_path / "headroom.json").exists()  # the run's record is train's gate's, never a check's
    failing = check_headroom(load_recipe(overrides={"headroom.max_ppl": 2.0}), run=tmp_path).to_dict()
    assert failing["verdict"] == "FAIL" and "raise the LoRA rank" in failing["remedies"][0]
