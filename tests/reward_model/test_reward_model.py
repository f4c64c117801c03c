"""The Bradley-Terry reward model, the reward stage, and the complete headroom gate."""

import json
import math

import pytest
import torch

from slm_align.cli import main
from slm_align.config import load_recipe
from slm_align.data.encoding import pad_batch
from slm_align.headroom.stage import check_headroom
from slm_align.modeling.models import build_tiny_model, load_model, resolve_source
from slm_align.reward_model.stage import run_reward
from slm_align.scoring.reward_model import (
    bradley_terry_loss,
    classifier_from_policy,
    load_reward_model,
    sequence_rewards,
)
from slm_align.sft.stage import run_sft
from tests.helpers import finished_sft_run


def test_bradley_terry_loss_on_hand_computed_values():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    expected = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)
    with_margin = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(2.0))) / 2
    assert bradley_terry_loss(chosen, rejected, margin=1.0).item() == pytest.approx(with_margin, rel=1e-6)
    centered = expected + 0.1 * (4.0 + 1.0) / 2
    assert bradley_terry_loss(chosen, rejected, center_coefficient=0.1).item() == pytest.approx(centered, rel=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2", "qwen2"])
def test_classifier_keeps_the_policy_backbone_and_pads_safely(tokenizer, arch):
    policy = build_tiny_model(arch, len(tokenizer), seed=3)
    classifier = classifier_from_policy(policy, tokenizer.pad_token_id)
    ids = torch.tensor([tokenizer("Once upon a time")["input_ids"]])
    with torch.no_grad():
        expected = policy.base_model(input_ids=ids).last_hidden_state
        got = classifier.base_model(input_ids=ids).last_hidden_state
        assert torch.equal(got, expected)
        short, long = tokenizer("A cat.")["input_ids"], tokenizer("Once upon a time there was a dog.")["input_ids"]
        alone = pad_batch([{"input_ids": short, "labels": short}], tokenizer.pad_token_id)
        both = pad_batch([{"input_ids": short, "labels": short}, {"input_ids": long, "labels": long}],
                         tokenizer.pad_token_id)
        r_alone = sequence_rewards(classifier, alone["input_ids"], alone["attention_mask"])
        r_both = sequence_rewards(classifier, both["input_ids"], both["attention_mask"])
    assert r_both[0].item() == pytest.approx(r_alone[0].item(), abs=1e-5)  # padding does not change a reward


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("rm") / "run", tiny_models["llama"], stories, steps=3)


def test_reward_stage_trains_saves_and_loads_alone(sft_run):
    out, recipe = sft_run
    recipe = recipe.model_copy(update={"reward": recipe.reward.model_copy(update={"max_steps": 4, "batch_size": 4})})
    result = run_reward(recipe, out)
    stage = out / "reward"
    assert sorted(p.name for p in stage.iterdir()) == ["eval_pairs.jsonl", "inputs.json", "log.jsonl",
                                                       "manifest.json", "model", "pairs.jsonl"]
    rows = [json.loads(line) for line in (stage / "pairs.jsonl").read_text().splitlines()]
    assert rows and set(rows[0]) == {"prompt", "chosen", "rejected", "kind"}
    model, tokenizer = load_reward_model(stage / "model")
    assert model.config.num_labels == 1 and not hasattr(model, "peft_config")
    initial = classifier_from_policy(load_model(resolve_source(recipe.model.source)), tokenizer.pad_token_id)
    assert not torch.equal(model.score.weight, initial.score.weight)  # the head trained...
    backbone_changed = [n for n, p in model.base_model.named_parameters()
                        if not torch.equal(p, initial.base_model.get_parameter(n))]
    assert backbone_changed and all("proj" in n for n in backbone_changed)  # ...and LoRA only touched projections
    metrics = result.metrics
    assert (0 <= metrics["accuracy"] <= 1
            and metrics["pairs"] == len((stage / "eval_pairs.jsonl").read_text().splitlines()))
    assert run_reward(recipe, out).skipped


def test_gate_fails_on_an_untrained_model_with_the_perplexity_reason(tmp_path, tokenizer, stories):
    from tests.conftest import save_tiny

    untrained = save_tiny("llama", tokenizer, tmp_path / "untrained")
    out = tmp_path / "run"
    run_sft(load_recipe(overrides={"model.source": str(untrained), "data.path": str(stories), "sft.max_steps": 1,
                                   "sft.learning_rate": 1e-6}), out)
    report = check_headroom(load_recipe(), run=out).to_dict()
    assert report["verdict"] == "FAIL"
    assert report["reasons"] == ["held-out perplexity "
                                 f"{report['figures'][0]['value']:.4g} is not < 20"]
    assert "SFT" in report["remedies"][0] and "LoRA rank" in report["remedies"][0]


def test_gate_fails_on_an_uninformative_reward_with_accuracy_and_spread_reasons(capsys, sft_run, tmp_path):
    out, recipe = sft_run
    policy = load_model(resolve_source(recipe.model.source))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.source)
    constant = classifier_from_policy(policy, tokenizer.pad_token_id)
    torch.nn.init.zeros_(constant.score.weight)  # scores every text the same: it cannot rank anything
    constant.save_pretrained(tmp_path / "constant")
    tokenizer.save_pretrained(tmp_path / "constant")
    with pytest.raises(SystemExit) as done:
        main(["check-headroom", "--run", str(out), "--reward-model", str(tmp_path / "constant"), "--max-ppl", "1e9",
              "--json"])
    report = json.loads(capsys.readouterr().out)
    assert done.value.code == 1
    names = {f["name"]: f for f in report["figures"]}
    assert names["reward accuracy (held-out pairs)"]["value"] == 0.5  # every pair a tie
    assert names["reward spread within prompts (mean std of 4 samples)"]["value"] == 0.0
    assert len(report["reasons"]) == 2 and any("preference data" in r for r in report["remedies"])
    assert any("more discriminative reward" in r for r in report["remedies"])


def test_bad_preference_file_from_the_cli(capsys, sft_run, tmp_path):
    out, _ = sft_run
    bad = tmp_path / "prefs.jsonl"
    bad.write_text('{"prompt": "x", "chosen": "y"}\n')
    with pytest.raises(SystemExit) as done:
        main(["train", "--stage", "reward", "--out", str(out), "--preferences", str(bad)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "prefs.jsonl:1" in err
