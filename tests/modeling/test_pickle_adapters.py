"""Pickle through adapters (issue 20, finding 8): an adapter saved only as adapter_model.bin needs
--allow-pickle, on every command that loads one (evaluate, merge, check-headroom, RL from an SFT
adapter kept as it is)."""

import json
import shutil

import pytest
import torch

from slm_align.errors import UserError
from slm_align.modeling.models import load_adapter, merged_policy, resolve_source
from tests.helpers import finished_sft_run, run_cli


def test_a_pickle_only_adapter_is_refused_unless_allowed(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match="--allow-pickle") as refused:
        load_adapter(None, tmp_path)
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="does not fit"):  # allowed: peft gets to try (and fails on this stub)
        load_adapter(None, tmp_path, allow_pickle=True)


def pickled_copy(adapter, out):
    """``adapter`` saved again as peft's pickle format only: adapter_model.bin
    (torch.save), no safetensors."""
    from safetensors.torch import load_file

    out.mkdir(parents=True)
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    torch.save(load_file(adapter / "adapter_model.safetensors"), out / "adapter_model.bin")
    return out


def pickle_only_stage(stage):
    """Turn a finished stage's adapter into a pickle-only one, its manifest still intact (it no
    longer lists the safetensors file)."""
    adapter = stage / "adapter"
    shutil.move(adapter, stage / "safe-adapter")
    pickled_copy(stage / "safe-adapter", adapter)
    manifest = json.loads((stage / "manifest.json").read_text())
    manifest["files"] = {name: digest for name, digest in manifest["files"].items() if not name.startswith("adapter/")}
    (stage / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def pickled_run(tmp_path_factory, tiny_models, stories):
    """A run with a finished SFT stage and an RL stage (two GRPO steps) whose adapter
    is saved only as pickle."""
    from slm_align.pipeline import run_rl

    out, recipe = finished_sft_run(tmp_path_factory.mktemp("pickled") / "run", tiny_models["llama"], stories, steps=2)
    small = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_prompts=2, algo="grpo")
    run_rl(recipe.model_copy(update={"rl": recipe.rl.model_copy(update=small)}), out, rewards=["length_window"],
           force=True)
    pickle_only_stage(out / "rl")
    return out


def one_line_refusal(code, err):
    return code == 2 and "adapter_model.bin" in err and "--allow-pickle" in err and err.count("\n") == 1


def test_evaluate_refuses_a_pickle_only_aligned_adapter_before_any_work_unless_allowed(capsys, pickled_run):
    ask = ("evaluate", "--run", pickled_run, "--reward", "length_window", "--prompts", "2", "--max-new-tokens", "4",
           "--json")
    code, _, err = run_cli(capsys, *ask)
    assert one_line_refusal(code, err) and "rl/adapter" in err and not (pickled_run / "eval").exists()
    code, stdout, err = run_cli(capsys, *ask, "--allow-pickle")
    assert code == 0, err
    assert [policy["name"] for policy in json.loads(stdout)["policies"]] == ["sft", "rl"]


def test_merge_refuses_a_pickle_only_adapter_unless_allowed_and_folds_it_in_when_allowed(capsys, pickled_run,
                                                                                         tmp_path):
    from transformers import AutoModelForCausalLM

    code, _, err = run_cli(capsys, "merge", "--run", pickled_run, "--out", tmp_path / "refused")
    assert one_line_refusal(code, err) and not (tmp_path / "refused").exists()
    code, _, err = run_cli(capsys, "merge", "--run", pickled_run, "--out", tmp_path / "merged", "--allow-pickle")
    assert code == 0, err
    source = resolve_source(json.loads((pickled_run / "sft" / "manifest.json").read_text())["inputs"]["model"]["ref"])
    policy = load_adapter(merged_policy(source, pickled_run / "sft" / "adapter"), pickled_run / "rl" / "safe-adapter")
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
        assert torch.allclose(merged, policy(ids).logits, atol=1e-5)  # the pickled RL adapter, folded in
        with policy.disable_adapter():
            assert not torch.allclose(merged, policy(ids).logits, atol=1e-5)  # (which is not the SFT prior alone)


def test_check_headroom_loads_a_pickle_only_adapter_with_allow_pickle(capsys, pickled_run, tiny_models, stories,
                                                                      tmp_path):
    pickled = pickled_copy(pickled_run / "sft" / "adapter", tmp_path / "adapter")
    ask = ("check-headroom", "--model", tiny_models["llama"], "--data", stories, "--max-ppl", "1e9", "--json")
    code, _, err = run_cli(capsys, *ask, "--adapter", pickled)
    assert one_line_refusal(code, err)
    code, stdout, err = run_cli(capsys, *ask, "--adapter", pickled, "--allow-pickle")
    assert code == 0, err
    from_pickle = json.loads(stdout)["figures"][0]["value"]
    code, stdout, _ = run_cli(capsys, *ask, "--adapter", pickled_run / "sft" / "adapter")
    assert from_pickle == json.loads(stdout)["figures"][0]["value"]  # the same adapter, whichever file it came from


def test_rl_from_an_sft_adapter_kept_as_it_is_refuses_a_pickle_only_one(pickled_run, tiny_models):
    from slm_align.config import Recipe
    from slm_align.envelope.policy import build_policy
    from slm_align.modeling.models import resolve_source

    rl = Recipe().rl
    settings = rl.model_copy(update={"envelope": rl.envelope.model_copy(update={"reinit_lora": False})})
    with pytest.raises(UserError, match="--allow-pickle"):
        build_policy(resolve_source(str(tiny_models["llama"])), pickled_run / "rl" / "adapter", settings, seed=0)
