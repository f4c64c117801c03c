"""RL inside the safety envelope: fault injection proves each guard; a
killed run resumes exactly."""

import copy
import json

import pytest
import torch

from slm_align.config import load_recipe
from slm_align.envelope.gate import GateRefused
from slm_align.envelope.guard import TrainingDiverged
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.envelope.policy import build_policy
from slm_align.envelope.value_head import ValueHead
from slm_align.errors import UserError
from slm_align.modeling.models import resolve_source
from slm_align.pipeline import run_rl
from slm_align.rl.grpo import GRPO
from slm_align.rl.learner import RolloutSource
from slm_align.rl.ppo import PPO
from tests.helpers import finished_sft_run


def varied_reward(prompts, completions, **_):
    """A cheap reward that differs between samples: longer completions score higher."""
    return [len(c.split()) / 10 for c in completions]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("rl") / "run", tiny_models["llama"], stories, steps=2)


def make_loop(sft_run, algo="grpo", loop_class=None, reward=varied_reward, **rl):
    out, recipe = sft_run
    envelope = recipe.rl.envelope.model_copy(update=rl.pop("envelope", {}))
    grpo = recipe.rl.grpo.model_copy(update=rl.pop("grpo", {}))
    small = dict(algo=algo, prompts_per_step=4, group_size=4, max_new_tokens=12, minibatch_size=8, envelope=envelope,
                 grpo=grpo)
    settings = recipe.rl.model_copy(update={**small, **rl})
    if loop_class is None:
        loop_class = PPO if algo == "ppo" else GRPO
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.source)
    policy = build_policy(resolve_source(recipe.model.source), out / "sft" / "adapter", settings, seed=0)
    value_head = ValueHead(policy.config.hidden_size) if algo == "ppo" else None
    prompts = ["Once upon a time, there was a cat.",
               "Tom found a red ball.", "One day, Mia was happy.", "The sun."]
    return loop_class(policy, tokenizer, reward, RolloutSource(prompts), settings, seed=0,
                      value_head=value_head)


def lora_state(loop):
    return {n: p.detach().clone() for n, p in loop.named_params}


def optimizer_state(loop):
    return copy.deepcopy(loop.optimizer.state_dict()["state"])


def same_state(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else same_state(a[k], b[k]) for k in a)


def prepared(loop):
    """A GRPO rollout, its advantages, and the rows of one minibatch."""
    batch = loop.rollout(0)
    return batch, loop.advantages(batch), torch.arange(8)


def test_step_zero_policy_equals_reference_and_first_ratio_is_one(sft_run):
    loop = make_loop(sft_run)
    ids = torch.tensor([loop.tokenizer("Once upon a time, there was a cat.")["input_ids"]])
    with torch.no_grad():
        logits = loop.policy(input_ids=ids).logits
        with loop.policy.disable_adapter():
            reference = loop.policy(input_ids=ids).logits
    assert torch.equal(logits, reference)  # merged SFT + zero-initialised LoRA == reference
    batch, _, rows = prepared(loop)
    loop.policy.train()
    new, _, _ = forward_logprobs(loop.policy, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_width,
                                 loop.settings.temperature)
    ratio = torch.exp(new - batch.old_logprobs[rows])[batch.mask[rows] > 0]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)  # temperature accounted for: ratio is 1


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_one_iteration_changes_every_lora_parameter(sft_run, algo):
    loop = make_loop(sft_run, algo=algo)
    before = lora_state(loop)
    metrics = loop.run_step(0)
    after = lora_state(loop)
    lora = [n for n in before if "lora_" in n]
    assert lora and all(not torch.equal(before[n], after[n]) for n in lora)
    for key in ("reward/mean", "kl", "entropy", "clip_frac", "ratio/mean", "guard/skipped", "guard/rollbacks",
                "completion/length", "tokens_per_s"):
        assert metrics[key] is not None
    if algo == "ppo":
        assert metrics["loss/value"] is not None and "value/explained_variance" in metrics


def first_update(loop) -> dict:
    """How iteration 0 moved each trainable parameter."""
    before = lora_state(loop)
    loop.run_step(0)
    return {name: value - before[name] for name, value in lora_state(loop).items()}


def test_warmup_scales_adams_first_update(sft_run):
    one_step = dict(epochs=1, minibatch_size=16, learning_rate=3e-4)  # 16 rows: one optimizer step
    full = first_update(make_loop(sft_run, **one_step))
    warmed = first_update(make_loop(sft_run, warmup_steps=2, **one_step))
    lora_b = [name for name in full if "lora_B" in name]  # B starts at 0, so A gets no gradient yet
    assert lora_b and all(full[name].abs().max() > 0 for name in lora_b)
    for name in full:  # Adam's first step is lr * m / sqrt(v): a third of the rate, a third of the move
        assert torch.allclose(warmed[name] * 3, full[name], rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_each_iteration_runs_at_its_warmed_rate_times_the_watchdogs_scale(sft_run, algo):
    loop = make_loop(sft_run, algo=algo, warmup_steps=2, learning_rate=3e-4)
    loop.lr_scale = 0.5  # a recovery halved the rate
    rates = [loop.run_step(step)["learning_rate"] for step in range(3)]
    assert rates == pytest.approx([0.5e-4, 1e-4, 1.5e-4])


class NaNGradientLoop(GRPO):
    fault = False

    def after_backward(self):
        if self.fault:
            self.params[0].grad.view(-1)[0] = float("nan")


def test_nan_gradient_restores_parameters_and_optimizer_state_bit_for_bit(sft_run):
    loop = make_loop(sft_run, loop_class=NaNGradientLoop)
    batch, adv, rows = prepared(loop)
    loop.minibatch(batch, rows, adv)  # a normal step first, so the optimizer has state
    params, state = lora_state(loop), optimizer_state(loop)
    loop.fault = True
    result = loop.minibatch(batch, rows, adv)
    assert result["rolled_back"] == 1 and loop.counters.rollbacks == 1
    assert same_state(lora_state(loop), params) and same_state(optimizer_state(loop), state)
    loop.fault = False
    loop.minibatch(batch, rows, adv)  # training continues
    assert not same_state(lora_state(loop), params) and loop.counters.consecutive_rollbacks == 0


def test_without_rollback_the_same_nan_corrupts_the_weights(sft_run):
    loop = make_loop(sft_run, loop_class=NaNGradientLoop, envelope={"rollback": False})
    batch, adv, rows = prepared(loop)
    loop.fault = True
    loop.minibatch(batch, rows, adv)
    assert any(not torch.isfinite(p).all() for p in loop.params)


def test_consecutive_rollbacks_stop_the_run_with_a_clear_message(sft_run):
    loop = make_loop(sft_run, loop_class=NaNGradientLoop, envelope={"max_consecutive_rollbacks": 3})
    batch, adv, rows = prepared(loop)
    loop.fault = True
    loop.minibatch(batch, rows, adv)
    loop.minibatch(batch, rows, adv)
    with pytest.raises(TrainingDiverged, match="3 consecutive rollbacks .*non-finite gradient"):
        loop.minibatch(batch, rows, adv)


@pytest.mark.parametrize("guard_on", [True, False])
def test_ratio_guard_skips_the_minibatch_entirely(sft_run, guard_on):
    loop = make_loop(sft_run, envelope={} if guard_on else {"ratio_guard": 0.0})
    batch, adv, rows = prepared(loop)
    loop.minibatch(batch, rows, adv)
    params, state = lora_state(loop), optimizer_state(loop)
    batch.old_logprobs = batch.old_logprobs - 3.0  # forces the ratio to e^3 ~ 20 > 5
    result = loop.minibatch(batch, rows, adv)
    assert result["ratio/mean"] > 5
    if guard_on:
        assert result["skipped"] == 1 and loop.counters.skipped == 1
        assert same_state(lora_state(loop), params) and same_state(optimizer_state(loop), state)
    else:  # the same fault, unguarded: the optimizer steps on it
        assert loop.counters.skipped == 0
        assert not same_state(lora_state(loop), params) and not same_state(optimizer_state(loop), state)


def test_frozen_adapter_is_refused(sft_run):
    out, recipe = sft_run
    settings = recipe.rl.model_copy(update={"envelope": recipe.rl.envelope.model_copy(update={"reinit_lora": False})})
    with pytest.raises(UserError, match="no policy parameter requires grad"):
        build_policy(resolve_source(recipe.model.source), out / "sft" / "adapter", settings, seed=0)


def rl_recipe(recipe, **rl):
    small = dict(steps=4, save_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_prompts=2)
    return recipe.model_copy(update={"rl": recipe.rl.model_copy(update={**small, **rl})})


def test_killed_run_resumes_to_the_same_result(sft_run, tmp_path, monkeypatch):
    import shutil

    out, recipe = sft_run
    recipe = rl_recipe(recipe, algo="ppo")
    for name in ("a", "b"):
        shutil.copytree(out / "sft", tmp_path / name / "sft")
    run_rl(recipe, tmp_path / "a", rewards=["tests.rl.test_guards:varied_reward"], force=True)
    original = PPO.run_step

    def killed_at_third(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(PPO, "run_step", killed_at_third)
    with pytest.raises(KeyboardInterrupt):
        run_rl(recipe, tmp_path / "b", rewards=["tests.rl.test_guards:varied_reward"], force=True)
    monkeypatch.undo()
    assert not (tmp_path / "b" / "rl").exists() and (tmp_path / "b" / "rl.partial" / "checkpoint.pt").is_file()
    resumed = run_rl(recipe, tmp_path / "b", rewards=["tests.rl.test_guards:varied_reward"], force=True, resume=True)
    assert resumed.metrics["steps"] == 4
    lines = [json.loads(x) for x in (tmp_path / "b" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    from safetensors.torch import load_file

    a = load_file(tmp_path / "a" / "rl" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "rl" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resume-equivalent
    assert (tmp_path / "b" / "rl" / "plots" / "training_curves.png").stat().st_size > 1000


def test_rl_seed_seeds_the_training_draws_and_a_kept_sft_seed_is_said(sft_run, tmp_path):
    import shutil

    from safetensors.torch import load_file

    out, recipe = sft_run
    runs = {"default": rl_recipe(recipe, algo="grpo", steps=2), "rl.seed=1": rl_recipe(recipe, algo="grpo", steps=2,
                                                                                        seed=1)}
    runs["seed=5"] = runs["default"].model_copy(update={"seed": 5})
    said, results, adapters = {}, {}, {}
    for name, settings in runs.items():
        shutil.copytree(out / "sft", tmp_path / name / "sft")
        said[name] = []
        results[name] = run_rl(settings, tmp_path / name, rewards=["tests.rl.test_guards:varied_reward"], force=True,
                               say=said[name].append)
        adapters[name] = load_file(tmp_path / name / "rl" / "adapter" / "adapter_model.safetensors")

    def same(a, b):
        return all(torch.equal(adapters[a][key], adapters[b][key]) for key in adapters[a])

    assert not same("default", "rl.seed=1") and same("default", "seed=5")  # the SFT's seed 0 was kept for seed=5
    assert results["default"].metrics["heldout_reward_sft"] == results["rl.seed=1"].metrics["heldout_reward_sft"]
    assert json.loads((tmp_path / "rl.seed=1" / "rl" / "manifest.json").read_text())["inputs"]["rl"]["seed"] == 1
    assert [line for line in said["seed=5"] if "seed" in line] == [
        "RL keeps the SFT stage's seed 0 (its split and held-out prompts), not seed 5: set rl.seed to seed RL's own "
        "draws"]
    assert not any("seed" in line for line in said["default"] + said["rl.seed=1"])


def test_gate_fail_refuses_unless_forced_and_the_manifest_records_it(tmp_path, tokenizer, stories):
    from tests.conftest import save_tiny

    untrained = save_tiny("llama", tokenizer, tmp_path / "untrained")
    recipe = load_recipe(overrides={"model.source": str(untrained), "data.path": str(stories), "sft.max_steps": 1})
    recipe = rl_recipe(recipe, algo="grpo", steps=1)
    with pytest.raises(GateRefused, match="headroom gate FAIL .*held-out perplexity") as refused:
        run_rl(recipe, tmp_path / "run", rewards=["length_window"])
    assert refused.value.exit_code == 1 and not (tmp_path / "run" / "rl").exists()
    result = run_rl(recipe, tmp_path / "run", rewards=["length_window"], force=True)
    manifest = json.loads((tmp_path / "run" / "rl" / "manifest.json").read_text())
    assert result.metrics["gate"] == manifest["metrics"]["gate"]
    assert manifest["metrics"]["gate"]["verdict"] == "FAIL" and manifest["inputs"]["forced"] is True


def test_two_process_data_parallel_run_ends_with_identical_replicas(sft_run, tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    out, _ = sft_run
    shutil.copytree(out / "sft", tmp_path / "run" / "sft")
    repo = Path(__file__).resolve().parents[2]  # so that the ranks can import tests.rl.test_guards:varied_reward
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "slm_align", "train",
               "--algo", "grpo", "--out", str(tmp_path / "run"), "--reward", "tests.rl.test_guards:varied_reward",
               "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--force"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(repo)))
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "rl" / "manifest.json").read_text())["metrics"]
    assert metrics["world_size"] == 2 and len(metrics["replica_digests"]) == 2
    assert metrics["replicas_identical"]  # each rank sampled other prompts; averaged gradients kept them equal


def test_zero_variance_groups_are_counted_and_resampled(sft_run):
    def first_prompt_is_constant(prompts, completions, **_):
        return [0.0 if p == prompts[0] else len(c) for p, c in zip(prompts, completions)]

    loop = make_loop(sft_run, grpo={"resample_zero_std": True})
    loop.reward_fn = first_prompt_is_constant
    loop.train_prompts = ["Once upon a time, there was a cat.", "Tom found a red ball."]
    plain = make_loop(sft_run)
    plain.reward_fn, plain.train_prompts = first_prompt_is_constant, loop.train_prompts
    first = plain.rollout(0)
    resampled = loop.rollout(0)
    zero, zero_again = first.all_equal, resampled.all_equal
    assert zero == zero_again >= 1
    g = loop.settings.group_size
    constant = [i for i in range(len(first.prompts)) if first.scores.view(-1, g)[i // g].std() == 0]
    assert [resampled.prompts[i] for i in range(len(first.prompts))] == first.prompts  # groups stay in place
    assert any(resampled.completions[i] != first.completions[i] for i in constant)  # those groups were redrawn
    kept = [i for i in range(len(first.prompts)) if i not in constant]
    assert all(resampled.completions[i] == first.completions[i] for i in kept)
    assert resampled.input_ids.shape[0] == first.input_ids.shape[0]
    assert resampled.mask.shape == resampled.old_logprobs.shape


def test_all_equal_groups_are_replaced_by_new_prompts_groups(sft_run):
    constant, varied = "The sun.", "Tom found a red ball."

    def constant_on_the_sun(prompts, completions, **_):
        return [0.0 if p == constant else len(c) for p, c in zip(prompts, completions)]

    def first_draw(step):  # one group without a signal, one with
        return [constant] * 4 + [varied] * 4

    refilling = make_loop(sft_run, prompts_per_step=2, grpo={"refill_flat": 2})
    plain = make_loop(sft_run, prompts_per_step=2)
    for loop in (refilling, plain):
        loop.reward_fn, loop.prompts_for = constant_on_the_sun, first_draw
        loop.train_prompts = [varied, "One day, Mia was happy."]  # what a refill may draw: each with a spread
    kept, refilled = plain.rollout(0), refilling.rollout(0)
    assert kept.prompts[:4] == [constant] * 4 and kept.refilled == 0  # off: the flat group stays
    assert constant not in refilled.prompts and set(refilled.prompts[:4]) <= set(refilling.train_prompts)
    assert len(set(refilled.prompts[:4])) == 1  # a whole group of one new prompt, in the flat group's place
    assert refilled.prompts[4:] == kept.prompts[4:] and refilled.completions[4:] == kept.completions[4:]
    assert refilled.all_equal == kept.all_equal == 1  # the first draw's count, as the watchdog reads it
    assert refilled.refilled == 1 and refilled.scores.view(-1, 4).std(-1).min() > 0  # every group now has a signal
    assert refilled.input_ids.shape[0] == refilled.mask.shape[0] == 8
    metrics = refilling.run_step(0)
    assert metrics["grpo/zero_std_frac"] == 0.5 and metrics["grpo/refilled_groups"] == 1.0
    assert metrics["grpo/trained_zero_std_frac"] == 0.0


def test_refilling_stops_after_its_rounds_and_keeps_a_group_that_stays_flat(sft_run):
    def constant(prompts, completions, **_):
        return [1.0 for _ in prompts]

    loop = make_loop(sft_run, prompts_per_step=2, grpo={"refill_flat": 3})
    loop.reward_fn = constant
    drawn = []
    sample = loop.sample

    def counting_sample(prompts, seed):
        drawn.append(len(prompts))
        return sample(prompts, seed)

    loop.sample = counting_sample
    batch = loop.rollout(0)
    assert drawn == [8, 8, 8, 8]  # the first draw, then both groups again in each of the 3 rounds
    assert batch.all_equal == 2 and batch.refilled == 6 and batch.scores.shape == (8,)


def test_reference_policy_is_the_merged_sft_model_and_not_the_base(sft_run):
    from slm_align.modeling.models import load_model, merged_policy

    out, recipe = sft_run
    source = resolve_source(recipe.model.source)
    loop = make_loop(sft_run)
    ids = torch.tensor([loop.tokenizer("Once upon a time, there was a cat.")["input_ids"]])
    with torch.no_grad(), loop.policy.disable_adapter():
        reference = loop.policy(input_ids=ids).logits
    with torch.no_grad():
        sft = merged_policy(source, out / "sft" / "adapter")(input_ids=ids).logits
        base = load_model(source)(input_ids=ids).logits
    assert torch.allclose(reference, sft, atol=1e-6)
    assert (reference - base).abs().max() > 1e-3  # the SFT adapter is in the reference, not thrown away


def test_a_rollout_with_no_training_token_stops_with_the_fix(sft_run):
    loop = make_loop(sft_run, mask_truncated=True, max_new_tokens=1)  # one token: every completion is cut
    before, state = lora_state(loop), optimizer_state(loop)
    with pytest.raises(UserError, match="raise --max-new-tokens or drop --mask-truncated"):
        loop.run_step(0)
    assert same_state(lora_state(loop), before) and same_state(optimizer_state(loop), state)


def test_a_non_finite_reward_names_the_term_and_the_prompt(sft_run):
    from slm_align.ondevice.rewards.protocol import CombinedReward

    def broken_on_the_sun(prompts, completions, **_):
        return [float("nan") if p == "The sun." else 0.0 for p in prompts]

    loop = make_loop(sft_run)
    loop.reward_fn = CombinedReward([("varied", varied_reward, 1.0), ("broken", broken_on_the_sun, 1.0)])
    loop.train_prompts = ["Tom found a red ball.", "The sun."]
    with pytest.raises(UserError, match="reward term 'broken' gave nan for prompt 'The sun.'"):
        loop.run_step(0)
    assert loop.counters.rollbacks == 0


def test_flat_algorithm_keys_of_older_recipes_move_into_their_sections(tmp_path):
    toml = tmp_path / "recipe.toml"
    toml.write_text("[rl]\nbeta = 0.1\nkl_coef = 0.2\n[rl.ppo]\ngamma = 0.9\n")
    recipe = load_recipe(toml, overrides={"rl.loss_type": "dr_grpo"})
    assert recipe.rl.grpo.beta == 0.1 and recipe.rl.grpo.loss_type == "dr_grpo"
    assert recipe.rl.ppo.kl_coef == 0.2 and recipe.rl.ppo.gamma == 0.9
    assert load_recipe(overrides={"rl.grpo.beta": 0.3}).rl.grpo.beta == 0.3


@pytest.mark.parametrize("overrides, message", [
    ({"rl.beta": 0.1, "rl.grpo.beta": 0.2}, "rl.beta and rl.grpo.beta are both set"),
    ({"rl.loss_type": "mean"}, "invalid setting rl.loss_type: "),  # named as written, not as rl.grpo.loss_type
    ({"rl.grpo.loss_type": "mean"}, "invalid setting rl.grpo.loss_type: "),
    ({"rl.no_such_key": 1}, "invalid setting rl.no_such_key: Extra inputs are not permitted"),
    ({"rl.ppo.beta": 1}, "invalid setting rl.ppo.beta: Extra inputs are not permitted"),
])
def test_bad_algorithm_keys_are_refused_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message) as refused:
        load_recipe(overrides=overrides)
    assert "\n" not in str(refused.value)


def one_outlier(prompts, completions, **_):
    """0.1 per word, except the first sample of each call, which scores 1000: an outlier to clip."""
    return [1000.0 if i == 0 else len(c.split()) / 10 for i, c in enumerate(completions)]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_the_three_sigma_clip_bounds_an_outlier_score_inside_the_loop(sft_run, algo):
    clipping = make_loop(sft_run, algo=algo, reward=one_outlier)
    batch = clipping.rollout(0)
    adv = clipping.advantages(batch).tokens
    assert batch.scores[0] == 1000.0 and clipping.counters.score_clipped >= 1  # the outlier was clipped
    off = make_loop(sft_run, algo=algo, reward=one_outlier, envelope={"sigma_clip": 0.0})
    unclipped = off.advantages(off.rollout(0)).tokens
    assert off.counters.score_clipped == 0 and off.counters.advantage_clipped == 0
    if algo == "ppo":  # whitened scores: without the clip the outlier's tokens weigh more
        assert float(unclipped[0].abs().max()) > float(adv[0].abs().max())
