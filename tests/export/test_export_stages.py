"""export --stage: any stage's policy of one run, each stage's artifacts in a folder of its own."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slm_align.export.publishing.adapter_export import adapter_chain
from slm_align.modeling.models import load_adapter, merged_policy, resolve_source
from slm_align.pipeline import run_rl
from slm_align.runs import MANIFEST, sha256_file
from tests.helpers import finished_sft_run, run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_models, stories):
    """A one-shot run: SFT then GRPO (two iterations)."""
    out, recipe = finished_sft_run(tmp_path_factory.mktemp("stages") / "run", tiny_models["llama"], stories, steps=2)
    small = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_prompts=2, algo="grpo")
    run_rl(recipe.model_copy(update={"rl": recipe.rl.model_copy(update=small)}), out, rewards=["length_window"],
           force=True)
    return out, recipe


def _logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()(torch.tensor([[5, 17, 42, 99, 7, 3]])).logits


def test_the_sft_policy_of_a_one_shot_run_exports_beside_the_rl_one(capsys, trained):
    run, recipe = trained
    code, out, _ = run_cli(capsys, "export", run, "--target", "gguf", "--quant", "F32", "--json")
    latest = json.loads(out)
    assert code == 0 and latest["dir"] == str(run / "export" / "model-F32.gguf")
    rl_bytes = (run / "export" / "model-F32.gguf").read_bytes()
    code, out, _ = run_cli(capsys, "export", run, "--stage", "sft", "--target", "gguf", "--quant", "F32", "--json")
    sft = json.loads(out)
    assert code == 0 and sft["dir"] == str(run / "export-sft" / "model-F32.gguf")
    assert sft["metrics"]["verification"]["passed"] and sft["metrics"]["sha256"] != latest["metrics"]["sha256"]
    assert (run / "export" / "model-F32.gguf").read_bytes() == rl_bytes  # the RL artifact is untouched
    manifests = {stage: json.loads((run / folder / "model-F32.gguf.json").read_text())
                 for stage, folder in (("rl", "export"), ("sft", "export-sft"))}
    assert {stage: m["inputs"]["stage"] for stage, m in manifests.items()} == {"rl": "rl", "sft": "sft"}
    # the SFT artifact holds the SFT policy: its merged checkpoint is base + SFT adapter, without RL's
    merged = json.loads((run / "merged-sft" / "manifest.json").read_text())
    assert merged["inputs"]["aligned_stage"] is None
    sft_policy = merged_policy(resolve_source(recipe.model.source), run / "sft" / "adapter").eval()
    with torch.no_grad():
        expected = sft_policy(torch.tensor([[5, 17, 42, 99, 7, 3]])).logits
    assert torch.allclose(_logits(run / "merged-sft"), expected, atol=1e-5)
    assert not torch.allclose(_logits(run / "merged"), expected, atol=1e-3)  # the latest is RL's
    card = (run / "export-sft" / "README.md").read_text()
    assert "- RL: GRPO" not in card and "- RL: GRPO" in (run / "export" / "README.md").read_text()  # its stages
    code, out, _ = run_cli(capsys, "export", run, "--stage", "rl", "--target", "gguf", "--quant", "F32", "--json")
    assert code == 0 and json.loads(out)["dir"] == str(run / "export-rl" / "model-F32.gguf")
    assert torch.equal(_logits(run / "merged-rl"), _logits(run / "merged"))  # rl is the latest: the same policy


@pytest.mark.parametrize("args, expected", [
    (["--stage", "ppo"], "--stage ppo: choose sft, rl, dpo, kto, rl-last"),
    (["--stage", "dpo"], "has no finished dpo stage"),
])
def test_a_stage_the_run_cannot_export_is_one_line(capsys, trained, args, expected):
    run, _ = trained
    code, out, err = run_cli(capsys, "export", run, "--target", "gguf", *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err
    assert not (run / "export-dpo").exists() and not (run / "export-ppo").exists()


def test_stage_needs_a_run(capsys, tmp_path, tiny_models):
    code, out, err = run_cli(capsys, "export", tiny_models["llama"], "--stage", "sft", "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "is not a run directory" in err and "drop --stage" in err
    assert not (tmp_path / "out").exists()


def _copy_with_last_adapter(run, out, change) -> None:
    """A copy of ``run``'s stages whose ``rl/adapter-last`` weights went through ``change`` (None: the folder
    removed, as a ``--watchdog off`` run has none), its manifest's checksums kept true to the files."""
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("export*", "merged*"))
    last = out / "rl" / "adapter-last"
    manifest = json.loads((out / "rl" / MANIFEST).read_text())
    if change is None:
        shutil.rmtree(last)
        manifest["files"] = {name: value for name, value in manifest["files"].items()
                             if not name.startswith("adapter-last/")}
    else:
        weights = last / "adapter_model.safetensors"
        save_file({name: change(name, tensor) for name, tensor in load_file(weights).items()}, weights,
                  metadata={"format": "pt"})
        manifest["files"]["adapter-last/adapter_model.safetensors"] = sha256_file(weights)
    (out / "rl" / MANIFEST).write_text(json.dumps(manifest))


def _moved_lora_b(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The last iteration differs from the published one: every LoRA B shifted by 0.05."""
    return tensor + 0.05 if "lora_B" in name else tensor


def test_rl_last_exports_the_last_iteration_where_the_watchdog_published_another(capsys, trained, tmp_path):
    """``--stage rl-last`` folds in ``rl/adapter-last``, not ``rl/adapter``: its merged logits are base + SFT +
    the last adapter's, and the export is recorded and carded as that policy."""
    run, recipe = trained
    copy = tmp_path / "run"
    _copy_with_last_adapter(run, copy, _moved_lora_b)
    code, out, err = run_cli(capsys, "export", copy, "--stage", "rl-last", "--target", "gguf", "--quant", "F32",
                             "--json")
    assert code == 0, err
    assert json.loads(out)["dir"] == str(copy / "export-rl-last" / "model-F32.gguf")
    manifest = json.loads((copy / "export-rl-last" / "model-F32.gguf.json").read_text())
    assert manifest["inputs"]["stage"] == "rl-last"
    merged = json.loads((copy / "merged-rl-last" / "manifest.json").read_text())["inputs"]
    assert merged["aligned_stage"] == "rl-last" and merged["aligned_adapter"] == str(copy / "rl" / "adapter-last")
    policy = merged_policy(resolve_source(recipe.model.source), copy / "sft" / "adapter")
    last = load_adapter(policy, copy / "rl" / "adapter-last").merge_and_unload().eval()
    with torch.no_grad():
        expected = last(torch.tensor([[5, 17, 42, 99, 7, 3]])).logits
    assert torch.allclose(_logits(copy / "merged-rl-last"), expected, atol=1e-5)
    run_cli(capsys, "merge", "--run", copy, "--stage", "rl")
    assert not torch.allclose(_logits(copy / "merged-rl"), expected, atol=1e-3)  # the published adapter differs
    card = (copy / "export-rl-last" / "README.md").read_text()
    assert "this model holds the last iteration's adapter (rl/adapter-last)" in card
    assert "(RL's last iteration, 2)" in card  # its held-out reward, not the published adapter's
    assert adapter_chain(copy, "rl-last") == [("sft", copy / "sft" / "adapter"),
                                              ("rl-last", copy / "rl" / "adapter-last")]  # the shipped adapter's


def test_rl_last_of_a_run_that_kept_no_last_adapter_is_one_line(capsys, trained, tmp_path):
    run, _ = trained
    copy = tmp_path / "run"
    _copy_with_last_adapter(run, copy, None)
    code, out, err = run_cli(capsys, "export", copy, "--stage", "rl-last", "--target", "gguf")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "kept no rl/adapter-last" in err and "choose --stage rl" in err
    assert not (copy / "export-rl-last").exists() and not (copy / "merged-rl-last").exists()
