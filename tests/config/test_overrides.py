"""Settings from the command line: --set KEY=VALUE typed and validated like the TOML recipe, `config
show`, and the refusal of flags that only the other RL algorithm reads."""

import json

import pytest

from slm_align.config import Recipe, load_recipe
from slm_align.config.overrides import parse_sets, refuse_other_algorithm
from slm_align.errors import UserError
from tests.helpers import finished_sft_run, run_cli


def shown(capsys, *args):
    """`config show --json` with ``args``: {key: {value, default, doc}}."""
    code, out, err = run_cli(capsys, "config", "show", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_set_values_are_typed_like_the_toml(capsys):
    settings = shown(capsys, "--set", "sft.lora.r=32", "--set", "sft.learning_rate=1e-3", "--set", "rl.algo=grpo",
                     "--set", "rl.envelope.rollback=false", "--set", 'sft.lora.target_modules=["q_proj", "v_proj"]',
                     "--set", 'data.path="my corpus.txt"',
                     "--set", "reward.pairs.mix={ shuffle = 2.0 }")
    assert settings["sft.lora.r"]["value"] == 32 and settings["sft.learning_rate"]["value"] == 0.001
    assert settings["rl.algo"]["value"] == "grpo" and settings["rl.envelope.rollback"]["value"] is False
    assert settings["sft.lora.target_modules"]["value"] == ["q_proj", "v_proj"]
    assert settings["data.path"]["value"] == "my corpus.txt"
    assert settings["reward.pairs.mix"]["value"] == {"shuffle": 2.0}


def test_set_overrides_the_toml_and_a_named_flag_wins_over_set(capsys, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("seed = 3\n[sft.lora]\nr = 8\n")
    settings = shown(capsys, "--config", recipe, "--set", "sft.lora.r=64")
    assert settings["seed"]["value"] == 3 and settings["sft.lora.r"]["value"] == 64
    from slm_align.config.overrides import merged_overrides

    assert merged_overrides(["sft.lora.r=64"], {"sft.lora.r": 4, "seed": None}) == {"sft.lora.r": 4, "seed": None}
    assert merged_overrides(["sft.lora.r=64"], {"sft.lora.r": None}) == {"sft.lora.r": 64}


def test_flat_rl_keys_are_accepted_as_in_the_toml():
    assert load_recipe(overrides=parse_sets(["rl.beta=0.2"])).rl.grpo.beta == 0.2


BAD_SETS = {
    "not a number": (["--set", "sft.lora.r=abc"], "invalid setting sft.lora.r"),
    "out of range": (["--set", "sft.lora.r=0"], "invalid setting sft.lora.r"),
    "not a choice": (["--set", "rl.grpo.loss_type=mean"], "invalid setting rl.grpo.loss_type"),
    "unknown key": (["--set", "sft.lora.rank=8"], "no recipe setting sft.lora.rank"),
    "unknown section": (["--set", "optimizer.lr=1"], "no recipe setting optimizer.lr"),
    "no value": (["--set", "sft.lora.r"], "expected KEY=VALUE"),
    "no key": (["--set", "=3"], "expected KEY=VALUE"),
}


@pytest.mark.parametrize("case", sorted(BAD_SETS))
def test_bad_set_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, case):
    args, expected = BAD_SETS[case]
    for command in (["sft", "--out"], ["train", "--out"], ["check-headroom", "--run"], ["evaluate", "--run"],
                    ["merge", "--run"]):
        code, _, err = run_cli(capsys, *command, tmp_path / "run", *args)
        assert code == 2 and expected in err and err.count("\n") == 1, (command, err)
        assert not (tmp_path / "run").exists()
    code, _, err = run_cli(capsys, "config", "show", *args)
    assert code == 2 and expected in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["evaluate", "merge"])
def test_set_reaches_the_recipe_of_evaluate_and_merge(capsys, tmp_path, command):
    code, _, err = run_cli(capsys, command, "--run", tmp_path / "run", "--set", "compute.device=cuda")
    assert code == 2 and "--device cuda: no CUDA GPU here" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    """A finished SFT run whose base model is a copy of the tiny Llama (so a test
    may change its files)."""
    import shutil

    root = tmp_path_factory.mktemp("sets")
    base = root / "base"
    shutil.copytree(tiny_models["llama"], base)
    return finished_sft_run(root / "run", base, stories, steps=2)[0], base


def test_evaluate_samples_with_the_set_settings_and_a_named_flag_wins(capsys, sft_run):
    run, _ = sft_run
    common = ["evaluate", "--run", run, "--reward", "length_window", "--prompts", "2", "--json"]
    code, out, err = run_cli(capsys, *common, "--set", "rl.max_new_tokens=3", "--set", "rl.temperature=0.5")
    assert code == 0, err
    report = json.loads(out)
    assert report["max_new_tokens"] == 3 and report["temperature"] == 0.5
    assert all(len(p["completions"]) == 2 for p in report["policies"])
    code, out, err = run_cli(capsys, *common, "--set", "rl.max_new_tokens=3", "--max-new-tokens", "4")
    assert code == 0, err
    assert json.loads(out)["max_new_tokens"] == 4


def test_merge_takes_a_setting_from_set(capsys, sft_run, tmp_path):
    import torch
    from safetensors.torch import load_file

    run, base = sft_run
    weights = base / "model.safetensors"
    kept = tmp_path / "model.safetensors"
    torch.save(load_file(weights), base / "pytorch_model.bin")
    weights.rename(kept)  # the base is a pickle checkpoint now
    try:
        code, _, err = run_cli(capsys, "merge", "--run", run, "--out", tmp_path / "refused")
        assert code == 2 and "pickle" in err and not (tmp_path / "refused").exists()
        code, _, err = run_cli(capsys, "merge", "--run", run, "--out", tmp_path / "merged", "--set",
                               "model.allow_pickle=true")
        assert code == 0, err
        assert (tmp_path / "merged" / "model.safetensors").is_file()
    finally:  # the module's run keeps its safetensors base
        (base / "pytorch_model.bin").unlink()
        kept.rename(weights)


OTHER_ALGORITHM = {
    "GRPO flag with PPO": (["--algo", "ppo", "--loss-type", "dr_grpo"], "--loss-type is a GRPO setting"),
    "GRPO flag with the default algorithm": (["--beta", "0.1"], "--beta is a GRPO setting and --algo is ppo"),
    "PPO flag with GRPO": (["--algo", "grpo", "--kl-coef", "0.1"], "--kl-coef is a PPO setting and --algo is grpo"),
    "PPO switch with GRPO": (["--algo", "grpo", "--adaptive-kl"], "--adaptive-kl is a PPO setting"),
    "GRPO --set with PPO": (["--algo", "ppo", "--set", "rl.grpo.scale_rewards=none"],
                            "--set rl.grpo.scale_rewards is a GRPO setting"),
    "KTO flag with GRPO": (["--algo", "grpo", "--desirable-weight", "1.5"],
                           "--desirable-weight is a KTO setting and --algo is grpo: "
                           "drop it or use --algo kto"),
    "KTO flag with DPO": (["--algo", "dpo", "--undesirable-weight", "2"],
                          "--undesirable-weight is a KTO setting and --algo is dpo"),
    "DPO/KTO flag with PPO": (["--algo", "ppo", "--pref-beta", "0.2"],
                              "--pref-beta is a DPO/KTO setting and --algo is ppo: "
                              "drop it or use --algo dpo"),
    "DPO/KTO switch with auto": (["--algo", "auto", "--any-model"],
                                 "--any-model is a DPO/KTO setting and --algo is auto"),
    "DPO/KTO --set with GRPO": (["--algo", "grpo", "--set", "preference.steps=5"],
                                "--set preference.steps is a DPO/KTO setting"),
    "GRPO flag with DPO": (["--algo", "dpo", "--loss-type", "dr_grpo"],
                           "--loss-type is a GRPO setting and --algo is dpo"),
    "RL iterations with DPO": (["--algo", "dpo", "--steps", "20"],  # trained 60 steps without a word before
                               "--steps is a PPO/GRPO setting and --algo is dpo: drop it or use --algo ppo "
                               "(DPO's own: --pref-steps)"),
    "RL learning rate with KTO": (["--algo", "kto", "--rl-lr", "1e-4"], "(KTO's own: --pref-lr)"),
    "RL group size with KTO": (["--algo", "kto", "--group-size", "4"], "--group-size is a PPO/GRPO setting"),
}


@pytest.mark.parametrize("case", sorted(OTHER_ALGORITHM))
def test_the_other_algorithms_flags_are_refused(capsys, tmp_path, case):
    args, expected = OTHER_ALGORITHM[case]
    code, _, err = run_cli(capsys, "train", "--out", tmp_path / "run", *args)
    assert code == 2 and expected in err and err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_the_algorithm_from_the_toml_decides(capsys, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[rl]\nalgo = "grpo"\n')
    code, _, err = run_cli(capsys, "train", "--config", recipe, "--out", tmp_path / "run", "--kl-coef", "0.1")
    assert code == 2 and "--algo is grpo" in err


def test_own_and_shared_settings_pass_and_auto_takes_both():
    own = {"rl.grpo.loss_type": "dr_grpo", "rl.group_size": 4, "rl.ppo.kl_coef": None}
    refuse_other_algorithm("grpo", own, {})
    refuse_other_algorithm("auto", {"rl.grpo.beta": 0.1, "rl.ppo.kl_coef": 0.1}, {})
    with pytest.raises(UserError, match="--kl-coef is a PPO setting"):
        refuse_other_algorithm("grpo", {"rl.ppo.kl_coef": 0.1}, {"rl.ppo.kl_coef": "--kl-coef"})


def test_config_show_prints_each_setting_with_its_doc_and_default_as_a_loadable_recipe(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "config", "show", "--set", "sft.lora.r=32", "--set", "rl.algo=grpo")
    assert code == 0
    assert "r = 32  # LoRA rank. (default: 16)" in out
    assert '# source = (unset)  # HF directory, hub id or .gguf file; None = the bundled model. (default: unset)' in out
    recipe = tmp_path / "shown.toml"
    recipe.write_text(out)
    assert load_recipe(recipe) == load_recipe(overrides={"sft.lora.r": 32, "rl.algo": "grpo"})


def test_config_show_json_lists_every_field_with_doc_and_default(capsys):
    settings = shown(capsys)
    assert settings["rl.grpo.beta"] == {"value": 0.04, "default": 0.04,
                                        "doc": Recipe.model_fields["rl"].annotation.model_fields["grpo"]
                                        .annotation.model_fields["beta"].description}
    assert all(entry["doc"] for entry in settings.values())  # every field has its doc line
    assert len(settings) > 80
