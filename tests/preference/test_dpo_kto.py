"""DPO and KTO: the losses on hand-computed log-probabilities, the reference being the merged
SFT prior, NaN rollback, a bit-identical resume, learning a learnable preference on a tiny
model, and the CLI's refusals."""

import copy
import dataclasses
import json
import math
import shutil

import pytest
import torch

from slm_align.data.preferences import Labelled
from slm_align.envelope.run import Placement
from slm_align.errors import UserError
from slm_align.pipeline import run_preference
from slm_align.preference import dpo
from slm_align.preference.algorithms import preference_algorithm
from slm_align.preference.data import check_feedback_models, heldout_prompts, load_preference_data
from slm_align.preference.kto import balancing_weight, mismatched_rows
from slm_align.preference.learner import PreferenceLearner, sequence_logprobs
from slm_align.preference.losses import dpo_loss, kto_loss, kto_reference_point
from slm_align.stats import wilson_interval
from tests.helpers import finished_sft_run, run_cli


# ---- the math ------------------------------------------------------------------------------------
def test_dpo_loss_on_hand_computed_logprobs():
    chosen = torch.tensor([-1.0, -5.0])
    rejected = torch.tensor([-3.0, -2.0])
    chosen_ref = torch.tensor([-2.0, -4.0])
    rejected_ref = torch.tensor([-2.0, -4.0])
    terms = dpo_loss(chosen, rejected, chosen_ref, rejected_ref, beta=0.5)
    # pair 1: r_c = 0.5 * (-1 + 2) = 0.5, r_r = 0.5 * (-3 + 2) = -0.5, margin 1
    # pair 2: r_c = 0.5 * (-5 + 4) = -0.5, r_r = 0.5 * (-2 + 4) = 1, margin -1.5
    assert terms.rewards.tolist() == pytest.approx([1.0, -1.5])
    expected = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.5))]  # -log sigmoid(m) = log(1 + e^-m)
    assert terms.losses.tolist() == pytest.approx(expected)
    assert float(terms.loss) == pytest.approx(sum(expected) / 2)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    dpo_loss(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).loss.backward()
    assert float(chosen.grad) == pytest.approx(-0.05)  # -beta * sigmoid(0): descent raises log pi(chosen)
    assert float(rejected.grad) == pytest.approx(0.05)


def test_kto_loss_on_hand_computed_logprobs():
    logp = torch.tensor([-1.0, -4.0])
    ref = torch.tensor([-2.0, -2.0])
    desirable = torch.tensor([True, False])
    terms = kto_loss(logp, ref, desirable, torch.tensor(0.5), beta=0.5, desirable_weight=2.0, undesirable_weight=1.0)
    good = 2.0 * (1 - 1 / (1 + math.exp(-0.5 * (1.0 - 0.5))))  # rho = 1
    bad = 1.0 * (1 - 1 / (1 + math.exp(-0.5 * (0.5 + 2.0))))  # rho = -2
    assert terms.losses.tolist() == pytest.approx([good, bad])
    assert float(terms.loss) == pytest.approx((good + bad) / 2)
    assert terms.rewards.tolist() == pytest.approx([0.5, -1.0])


def test_kto_reference_point_is_the_mean_log_ratio_clamped_at_zero_without_gradient():
    policy = torch.tensor([-1.0, -3.0], requires_grad=True)
    assert float(kto_reference_point(policy, torch.tensor([-2.0, -3.0]))) == pytest.approx(0.5)
    assert float(kto_reference_point(policy, torch.tensor([0.0, 0.0]))) == 0.0
    assert not kto_reference_point(policy, torch.tensor([-2.0, -3.0])).requires_grad


def test_wilson_interval_matches_the_textbook_values():
    low, high = wilson_interval(8, 10)
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


# ---- data ----------------------------------------------------------------------------------------
def learnable_rows(count: int, offset: int = 0) -> list[dict]:
    """Pairs whose chosen side always opens with "Yes, indeed." and whose
    rejected side never does."""
    rows = []
    for i in range(offset, offset + count):
        prompt = f"Story {i}: the fox went to the river on day {i}."
        rest = f" It saw {i % 7} birds and a boat."
        rows.append({"prompt": prompt, "chosen": " Yes, indeed." + rest, "rejected": rest})
    return rows


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_the_split_is_by_prompt_and_kto_sees_pairs_as_good_and_bad(tmp_path):
    rows = learnable_rows(20)
    rows.append({"prompt": rows[0]["prompt"], "completion": " a thumbs-down answer",
                 "label": False})
    path = write_rows(tmp_path / "prefs.jsonl", rows)
    dpo = load_preference_data([path], None, "dpo", seed=0, fraction=0.25)
    kto = load_preference_data([path], None, "kto", seed=0, fraction=0.25)
    held = {p.prompt for p in dpo.heldout_pairs}
    assert len(held) == 5 and not held & {p.prompt for p in dpo.train_pairs}
    assert held == heldout_prompts({row["prompt"] for row in rows}, 0, 0.25)
    assert len(kto.train_labelled) == 2 * len(dpo.train_pairs) + (rows[0]["prompt"] not in held)
    assert {item.label for item in kto.train_labelled if item.completion.startswith(" Yes")} == {True}


def test_feedback_about_another_model_is_refused_unless_asked(tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    mine = "a" * 64
    (run / "export" / "model-F16.gguf.json").write_text(json.dumps({"metrics": {"sha256": mine}}))
    assert check_feedback_models({mine}, run, any_model=False)["matched"] == [mine]
    with pytest.raises(UserError, match="--any-model"):
        check_feedback_models({mine, "b" * 64}, run, any_model=False)
    assert check_feedback_models({"b" * 64}, run, any_model=True)["foreign"] == ["b" * 64]
    assert check_feedback_models(set(), run, any_model=False)["foreign"] == []  # TRL rows carry no model_id


# ---- the stage on a tiny model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("pref") / "run", tiny_models["llama"], stories, steps=2)


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("prefs") / "prefs.jsonl", learnable_rows(60))


def preference_recipe(recipe, algo, prefs, **settings):
    settings = dict(dict(steps=30, learning_rate=5e-3, batch_size=8, eval_every=10, save_steps=10), **settings)
    return recipe.model_copy(update={
        "rl": recipe.rl.model_copy(update={"algo": algo}),
        "preference": recipe.preference.model_copy(update=settings),
        "reward": recipe.reward.model_copy(update={"preferences": [str(prefs)]})})


def fresh_run(sft_run, out):
    base, recipe = sft_run
    shutil.copytree(base / "sft", out / "sft")
    return recipe


@pytest.fixture(scope="module")
def aligned(sft_run, prefs, tmp_path_factory):
    """One run holding the SFT prior and a DPO and a KTO stage (30 steps each on the learnable
    pairs), and each stage's manifest metrics."""
    out = tmp_path_factory.mktemp("aligned") / "run"
    recipe = fresh_run(sft_run, out)
    metrics = {}
    for algo in ("dpo", "kto"):
        metrics[algo] = run_preference(preference_recipe(recipe, algo, prefs), out, force=True).metrics
    return out, metrics


@pytest.mark.parametrize("algo", ["dpo", "kto"])
def test_a_learnable_preference_is_learned_on_held_out_prompts(aligned, algo):
    out, results = aligned
    metrics = results[algo]
    assert metrics["heldout_before"]["pair_accuracy"] == 0.0  # the policy starts as the reference: no margin
    assert metrics["heldout_accuracy"]["kind"] == "pair_accuracy"
    assert metrics["heldout_accuracy"]["value"] > 0.8
    low, high = metrics["heldout_accuracy"]["ci95"]
    assert low <= metrics["heldout_accuracy"]["value"] <= high
    assert (out / algo / "adapter" / "adapter_model.safetensors").is_file()
    logged = [json.loads(line) for line in (out / algo / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 30 and "heldout/pair_accuracy" in logged[9]
    assert metrics["gate"]["forced"] is True  # a 2-step SFT prior is not fluent: recorded


def test_evaluate_reports_dpo_and_kto_beside_sft_with_held_out_accuracy_and_its_interval(aligned, capsys):
    out, results = aligned
    code, stdout, err = run_cli(capsys, "evaluate", "--run", out, "--reward", "length_window", "--prompts", "4",
                                "--max-new-tokens", "8", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report == json.loads((out / "eval" / "report.json").read_text())
    assert [p["name"] for p in report["policies"]] == ["sft", "dpo", "kto"]
    assert [(c["baseline"], c["policy"]) for c in report["comparisons"]] == [("sft", "dpo"), ("sft", "kto")]
    assert [record["stage"] for record in report["preference"]] == ["dpo", "kto"]
    markdown = (out / "eval" / "report.md").read_text()
    section = markdown.split("## Preference optimisation")[1]
    assert "| dpo |" in markdown and "| kto |" in markdown
    for record in report["preference"]:
        headline = results[record["stage"]]["heldout_accuracy"]
        low, high = record["ci95"]
        assert record["kind"] == "pair_accuracy" and record["after"] == headline["value"] > 0.8
        assert record["before"] == 0.0 and record["heldout_pairs"] == 12 and record["steps"] == 30
        assert 0.0 <= low <= record["after"] <= high <= 1.0 and (low, high) == tuple(headline["ci95"])
        row = (f"| {record['stage']} (pair accuracy) | 0.000 | {record['after']:.3f} | [{low:.3f}, "
               f"{high:.3f}] | 12 | 30 |")
        assert row in section


def make_learner(sft_run, prefs, algo: str, checkpointing: bool = False) -> PreferenceLearner:
    """A DPO or KTO learner on ``prefs`` from the module's SFT prior (merged, a fresh LoRA),
    as the stage builds it."""
    from slm_align.envelope.policy import build_policy
    from slm_align.modeling.models import load_tokenizer, resolve_source

    base, recipe = sft_run
    recipe = preference_recipe(recipe, algo, prefs)
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source)
    data = load_preference_data([prefs], tokenizer, algo, recipe.seed, 0.2)
    policy = build_policy(source, base / "sft" / "adapter", recipe.rl, recipe.seed)
    placement = Placement(checkpointing=checkpointing)
    return preference_algorithm(algo)(policy, tokenizer, data, recipe.preference, recipe.rl.envelope,
                                      recipe.seed, recipe.data.max_length, placement)


@pytest.mark.parametrize("algo", ["dpo", "kto"])
def test_every_step_that_scores_new_answers_still_checkpoints_its_layers(sft_run, prefs, algo, monkeypatch):
    learner = make_learner(sft_run, prefs, algo, checkpointing=True)
    layer_class = type(learner.policy.get_base_model().model.layers[0])
    forward = layer_class.forward
    calls = []

    def recorded(self, *args, **kwargs):
        calls.append((torch.is_grad_enabled(), self.training))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", recorded)
    layers = learner.policy.config.num_hidden_layers
    for _ in range(2):  # the first step scores its answers under the reference first
        calls.clear()
        learner.train_step()
        with_grad = [training for grad, training in calls if grad]
        assert with_grad == [True] * (2 * layers)  # one forward, one recompute in the backward pass
        assert any(not grad for grad, _ in calls)  # the no-gradient passes ran as well


def test_the_reference_is_the_merged_sft_prior_and_the_first_step_starts_from_it(sft_run, prefs):
    from slm_align.modeling.models import merged_policy, resolve_source

    base, recipe = sft_run
    source = resolve_source(recipe.model.source)
    adapter = base / "sft" / "adapter"
    learner = make_learner(sft_run, prefs, "dpo")
    prior = merged_policy(source, adapter).float().eval()
    with torch.no_grad():
        expected, _ = sequence_logprobs(prior, learner.chosen.rows, learner.pad_id, 4)
        base_only, _ = sequence_logprobs(merged_policy(source, None).float().eval(), learner.chosen.rows,
                                         learner.pad_id, 4)
    assert torch.allclose(learner.chosen.ref, expected, atol=1e-4)
    assert not torch.allclose(learner.chosen.ref, base_only, atol=1e-3)  # the SFT adapter is merged in
    first = learner.train_step()
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # margin 0 at the first step: -log sigmoid(0)


def nan_loss(learner, monkeypatch) -> list:
    """A NaN loss: caught before backward, so nothing has moved yet when
    the snapshot is restored."""
    original = dpo.dpo_loss

    def poisoned(*args, **kwargs):
        terms = original(*args, **kwargs)
        return dataclasses.replace(terms, loss=terms.loss * float("nan"))

    monkeypatch.setattr(dpo, "dpo_loss", poisoned)
    return []


def nan_parameter_after_the_step(learner, monkeypatch) -> list:
    """A NaN written into a parameter right after AdamW's step: caught only then, when every
    parameter and every moment and step count has moved, so only a working restore puts them back.
    Returns what the hook saw."""
    seen = []

    def poison(optimizer, args, kwargs):
        seen.append({"params": {n: p.detach().clone() for n, p in learner.named_params},
                     "optimizer": copy.deepcopy(optimizer.state_dict())})
        with torch.no_grad():
            learner.params[0].view(-1)[0] = float("nan")

    learner.optimizer.register_step_post_hook(poison)
    return seen


def same_tensors(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values equal bit for bit (same keys,
    torch.equal on tensors)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("fault", [nan_loss, nan_parameter_after_the_step])
def test_a_non_finite_step_rolls_back_every_parameter_and_the_whole_optimizer_state(sft_run, prefs, monkeypatch,
                                                                                     fault):
    learner = make_learner(sft_run, prefs, "dpo")
    learner.train_step()
    learner.train_step()  # AdamW holds exp_avg, exp_avg_sq and step for every trainable parameter
    params_before = {name: param.detach().clone() for name, param in learner.named_params}
    optimizer_before = copy.deepcopy(learner.optimizer.state_dict())
    assert len(optimizer_before["state"]) == len(learner.params) > 1
    seen = fault(learner, monkeypatch)
    result = learner.train_step()
    assert result["rolled_back"] == 1 and learner.guard.counters.rollbacks == 1
    if seen:  # the failed step had moved every parameter and every piece of AdamW state before it was caught
        moved = seen[0]
        assert all(not torch.equal(moved["params"][n], params_before[n]) for n in params_before)
        for index, state in optimizer_before["state"].items():
            after_step = moved["optimizer"]["state"][index]
            assert float(after_step["step"]) == float(state["step"]) + 1
            assert not torch.equal(after_step["exp_avg_sq"], state["exp_avg_sq"])
    assert same_tensors({n: p.detach() for n, p in learner.named_params}, params_before)
    assert same_tensors(learner.optimizer.state_dict(), optimizer_before)
    assert all(param.grad is None for param in learner.params)


def test_kto_checkpoint_restores_the_cached_reference_scores_and_continues_the_same(sft_run, prefs, tmp_path):
    """KTO scores each training answer (and its mismatched pair) under the reference on first use; a
    checkpoint keeps those scores, NaN where not computed yet, and a fresh learner loaded from it
    takes the same next step."""
    learner = make_learner(sft_run, prefs, "kto")
    for _ in range(3):
        learner.train_step()
    torch.save(learner.state_dict(), tmp_path / "checkpoint.pt")  # as the stage saves it (no tensor shared)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    cache = state["references"]
    assert set(cache) == {"completions", "mismatched"}
    assert torch.isnan(cache["completions"]).any() and not torch.isnan(cache["completions"]).all()
    resumed = make_learner(sft_run, prefs, "kto")
    resumed.load_state_dict(state)
    for name, scores in resumed.state_dict()["references"].items():
        assert torch.equal(torch.isnan(scores), torch.isnan(cache[name]))
        assert torch.equal(scores.nan_to_num(), cache[name].nan_to_num())
    assert resumed.step == 3 and resumed.train_step() == learner.train_step()
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, learner.params))


def test_a_killed_run_resumes_bit_identical(sft_run, prefs, tmp_path, monkeypatch):
    recipe = preference_recipe(fresh_run(sft_run, tmp_path / "whole"), "dpo", prefs, steps=12, save_steps=4)
    run_preference(recipe, tmp_path / "whole", force=True)
    fresh_run(sft_run, tmp_path / "killed")
    original = dpo.DPO.train_step

    def killed_at_seven(self):
        if self.step == 6:  # after the checkpoint at step 4: steps 5 and 6 are trained again
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(dpo.DPO, "train_step", killed_at_seven)
    with pytest.raises(KeyboardInterrupt):
        run_preference(recipe, tmp_path / "killed", force=True)
    monkeypatch.setattr(dpo.DPO, "train_step", original)
    with pytest.raises(UserError, match="--resume"):
        run_preference(recipe, tmp_path / "killed", force=True)
    resumed = run_preference(recipe, tmp_path / "killed", force=True, resume=True)
    adapter = "dpo/adapter/adapter_model.safetensors"
    assert (tmp_path / "killed" / adapter).read_bytes() == (tmp_path / "whole" / adapter).read_bytes()
    assert (tmp_path / "killed" / "dpo" / "metrics.jsonl").read_text() == \
        (tmp_path / "whole" / "dpo" / "metrics.jsonl").read_text()
    assert resumed.metrics["heldout_before"] == json.loads(
        (tmp_path / "whole" / "dpo" / "manifest.json").read_text())["metrics"]["heldout_before"]


# ---- the command line ----------------------------------------------------------------------------
def test_cli_dpo_without_preferences_or_with_too_few_is_one_line(sft_run, tmp_path, capsys):
    base, _ = sft_run
    out = tmp_path / "run"
    shutil.copytree(base / "sft", out / "sft")
    code, stdout, stderr = run_cli(capsys, "train", "--algo", "dpo", "--out", out)
    assert code == 2 and "--preferences" in stderr and len(stderr.strip().splitlines()) == 1
    few = write_rows(tmp_path / "few.jsonl", learnable_rows(6))
    code, stdout, stderr = run_cli(capsys, "train", "--algo", "kto", "--out", out, "--preferences", few)
    assert code == 1 and "training labelled completions" in stderr
    assert not (out / "kto").exists() and not (out / "kto.partial").exists()


@pytest.mark.parametrize("args, message", [
    (["--algo", "dpo", "--desirable-weight", "2"], "--desirable-weight is a KTO "
                                                   "setting and --algo is dpo"),
    (["--algo", "ppo", "--pref-beta", "0.2"], "--pref-beta is a DPO/KTO setting and --algo is ppo"),
    (["--algo", "kto", "--beta", "0.2"], "--beta is a GRPO setting and --algo is kto"),
])
def test_a_setting_of_another_algorithm_is_refused(tmp_path, capsys, args, message):
    code, _, stderr = run_cli(capsys, "train", "--out", tmp_path / "run", *args)
    assert code == 2 and message in stderr and not (tmp_path / "run").exists()


class RecordingEncoder:
    """An encoder that returns the (prompt, completion) it was asked for as the row."""

    def row(self, prompt: str, completion: str) -> dict:
        return {"prompt": prompt, "completion": completion}


def test_kto_mismatched_pairs_take_a_completion_of_another_prompt():
    items = [Labelled("p1", "c1", True), Labelled("p1", "c2", False), Labelled("p2", "c3", True),
             Labelled("p3", "c4", False), Labelled("p3", "c5", True)]
    rows = mismatched_rows(RecordingEncoder(), items)
    assert [(row["prompt"], row["completion"]) for row in rows] == [
        ("p1", "c3"), ("p1", "c3"), ("p2", "c4"), ("p3", "c1"), ("p3", "c1")]  # never the same prompt's answer
    same = [Labelled("p", "a", True), Labelled("p", "b", False)]
    assert [row["completion"] for row in mismatched_rows(RecordingEncoder(), same)] == ["b", "a"]  # no other


def test_kto_default_desirable_weight_balances_the_labels_with_the_undesirable_weight():
    labels = [True] * 2 + [False] * 6
    assert balancing_weight(labels) == 3.0  # 3 x 2 good = 1 x 6 bad
    weight = balancing_weight(labels, undesirable_weight=0.5)
    assert weight * 2 == 0.5 * 6  # both labels weigh the same in total
    assert balancing_weight([True, True]) == 1.0
