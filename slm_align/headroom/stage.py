"""The headroom gate: is the SFT prior fluent enough (and, later, the reward
discriminative enough) for RL?

The report is a list of figures, each with its threshold, verdict and remedy, so that later checks
(reward accuracy, reward spread) join the same table.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from slm_align.atomic import write_json_atomic
from slm_align.config import Recipe
from slm_align.config.from_sft import recipe_from_sft
from slm_align.data.corpus import load_corpus, source_fingerprint
from slm_align.data.encoding import encode_all
from slm_align.data.prompt_source import prompt_source
from slm_align.data.readers import fingerprint
from slm_align.envelope.gate import Figure, HeadroomReport
from slm_align.errors import UserError
from slm_align.modeling.accelerator import device_of, resolve_device
from slm_align.modeling.models import load_adapter, load_model, load_tokenizer, require_adapter, resolve_source
from slm_align.ondevice.rewards.protocol import reward_bounds
from slm_align.ondevice.rewards.spread import CASE_REMEDIES, flat_case, measure_spread, recommend
from slm_align.progress import stage_lines
from slm_align.rollouts.episodes import agent_tasks, check_task_file, episode_scores, run_episodes
from slm_align.runs import ALIGNED_STAGES, artifact_digest, digest, read_manifest, stage_identity
from slm_align.scoring.learned_reward import learned_reward
from slm_align.scoring.perplexity import perplexity

REPORT = "headroom.json"
"""The gate's report in a run directory (written by ``train``'s gate, never by ``check-headroom``)."""
GATE_STAGES = ("sft", *ALIGNED_STAGES)
"""The policies the gate can judge: the SFT prior (what ``train`` gates) or an aligned stage's."""
REMEDY_PPL = ("the SFT prior is not fluent enough for RL to help: train SFT longer or on more or "
              "cleaner data, raise the LoRA rank (--lora-r), or start from a larger base model")
REMEDY_ACCURACY = ("the reward model cannot tell better from worse: give it more or better "
                   "preference data (--preferences, another pair mix) or train it longer")
REMEDY_SPREAD = CASE_REMEDIES["flat"]


def _heldout_pairs(recipe: Recipe, corpus, run: Optional[Path]) -> list:
    """The reward stage's own held-out pairs when the run has them, else pairs
    made from the eval split."""
    from slm_align.data.pairs import Pair, synthetic_pairs

    saved = Path(run) / "reward" / "eval_pairs.jsonl" if run is not None else None
    if saved is not None and saved.is_file():
        return [Pair(**json.loads(line)) for line in saved.read_text(encoding="utf-8").splitlines() if line]
    return synthetic_pairs(corpus.splits.eval, recipe.reward.pairs, recipe.seed + 1)[0]


@dataclass(frozen=True)
class GateReward:
    """The reward the gate measures."""

    model: Optional[Path]
    """The learned reward model's directory (None: reward functions only)."""
    functions: Sequence[str]
    """Reward functions by name or ``module:function[@weight]``."""
    run: Optional[Path]
    """The run whose reward stage kept its held-out pairs (None: pairs from the eval split)."""


def _reward_figures(recipe: Recipe, corpus, source, policy, tokenizer, given: GateReward,
                    info: dict) -> list[Figure]:
    """Held-out pairwise accuracy of the reward model and the spread of
    rewards over policy samples."""
    from slm_align.scoring.reward_model import pairwise_metrics

    settings = recipe.headroom
    learned_model = learned_reward(given.model, device_of(policy))
    reward = source.reward(given.functions, learned=learned_model)
    figures = []
    if given.model is not None:
        pairs = _heldout_pairs(recipe, corpus, given.run)
        if pairs:
            learned = next(fn for name, fn, _ in reward.terms if name == "reward_model")
            metrics = pairwise_metrics(learned.model, learned.tokenizer, pairs,
                                       recipe.data.max_length)
            info["reward_accuracy_by_kind"] = metrics["accuracy_by_kind"]
            figures.append(Figure("reward accuracy (held-out pairs)", metrics["accuracy"],
                                  settings.min_reward_accuracy, ">=", REMEDY_ACCURACY))
        else:
            info["reward_accuracy"] = "not measured: no held-out preference pairs"
    prompts = source.heldout[: settings.spread_prompts]
    if len(prompts) < 2:
        info["reward_spread"] = "not measured: fewer than two held-out prompts"
        return figures
    return figures + [_spread_figure(recipe, policy, tokenizer, reward, prompts, info, source)]


def _spread_figure(recipe: Recipe, policy, tokenizer, reward, prompts: list[str], info: dict, source) -> Figure:
    """Sample k completions (or agent episodes, when RL will run them) per prompt, gate on the
    within-prompt spread, and advise PPO or GRPO."""
    from slm_align.modeling.generation import sample, score

    settings = recipe.headroom
    k = settings.samples_per_prompt
    temperature = spread_temperature(recipe)
    repeated = [prompt for prompt in prompts for _ in range(k)]
    tasks = agent_tasks(recipe.rl, source.tasks)
    if tasks is None:
        samples = sample(policy, tokenizer, repeated, settings.max_new_tokens, temperature=temperature,
                         seed=recipe.seed)
        scores = score(reward, samples)
    else:  # RL will run agent episodes: the spread is measured on episodes too
        tasks.check_template(tokenizer)
        rl = recipe.rl.model_copy(update={"max_new_tokens": settings.max_new_tokens, "temperature": temperature})
        scores = episode_scores(reward, repeated, run_episodes(policy, tokenizer, repeated, rl, recipe.seed, tasks))
        info["spread_unit"] = "agent episodes"
    spread = measure_spread(scores, k)
    info["spread_samples"] = len(repeated)
    info["spread_temperature"] = temperature
    info["reward_terms"] = [name for name, _, _ in reward.terms]
    info["reward_spread"] = spread.to_dict()
    info["recommendation"] = recommend(spread, settings.max_all_equal_share, recipe.rl.group_size)
    figure = Figure(f"reward spread within prompts (mean std of {k} samples)",
                    spread.within, settings.min_reward_std, ">=", REMEDY_SPREAD)
    if not figure.passed:  # say which case the flat spread is: solved, unreached or flat
        case = flat_case(scores, reward_bounds(reward))
        info["spread_case"] = case.to_dict()
        figure.remedy = case.remedy
    return figure


def spread_temperature(recipe: Recipe) -> float:
    """The temperature the spread is sampled at: ``headroom.temperature``, else RL's, since GRPO's
    advantage is zero exactly where a group's rewards agree at the temperature RL samples at."""
    given = recipe.headroom.temperature
    return recipe.rl.temperature if given is None else given


def _perplexity_documents(recipe: Recipe, corpus, source) -> list:
    """The SFT prior is scored on the corpus's eval split; with a task file and no corpus, on the
    held-out tasks (prompt and answer), the text the model must be fluent in."""
    from slm_align.data.examples import Example

    if recipe.data.tasks is None or recipe.data.path is not None:
        return corpus.splits.eval[: recipe.headroom.max_documents]
    return [Example(text=text) for text in source.heldout_texts()[: recipe.headroom.max_documents]]


def _gate_plan(recipe: Recipe, documents: int, source, reward_known: bool) -> str:
    """What the gate will measure, and on how much (its start line in a log)."""
    plan = f"the prior's perplexity on {documents} documents"
    if not reward_known:
        return plan
    settings = recipe.headroom
    prompts = len(source.heldout[: settings.spread_prompts])
    samples = settings.samples_per_prompt
    return f"{plan}, the reward's accuracy and its spread over {samples} samples of {prompts} prompts"


def _prior(recipe: Recipe, model_source, device: str, adapters: tuple[Optional[Path], Optional[Path]],
           encoded: list, pad_id: int, info: dict):
    """The policy the gate measures: the model with the SFT adapter when there is one (the base
    model's perplexity recorded in ``info`` as context); with an aligned stage's adapter, that adapter
    on the merged SFT prior (the prior's perplexity as context)."""
    sft, aligned = adapters
    model = load_model(model_source, recipe.model.trust_remote_code, recipe.model.allow_pickle).to(device)
    if sft is not None:
        info["adapter"] = str(sft)
        model = load_adapter(model, sft, recipe.model.allow_pickle)
    if aligned is not None:
        info["aligned_adapter"] = str(aligned)
        model = model.merge_and_unload() if sft is not None else model
        model = load_adapter(model, aligned, recipe.model.allow_pickle)
    if sft is None and aligned is None:
        return model
    context = "prior" if aligned is not None else "base"
    with model.disable_adapter():
        info[f"{context}_ppl"] = perplexity(model, encoded, pad_id, recipe.headroom.batch_size,
                                            f"{context} perplexity").ppl
    return model


Subject = tuple[Recipe, Optional[Path], Optional[Path]]
"""The recipe the gate measures with, the SFT adapter and the reward model."""


def gate_subject(recipe: Recipe, run: Optional[Path], adapter: Optional[Path],
                 reward_model: Optional[Path], rewards: Sequence[str] = ()) -> Subject:
    """What the gate measures: the run's SFT prior when no adapter is given (its recipe's model,
    seed and data), and the run's reward model when neither a reward model nor reward functions are
    given and the run has one (as ``train`` takes them: ``--reward`` alone means the functions alone)."""
    if run is not None and adapter is None and recipe.rl.from_sft:
        recipe, adapter = recipe_from_sft(run, recipe)
    own = Path(run) / "reward" / "model" if run is not None else None
    if reward_model is None and not rewards and own is not None and own.is_dir():
        reward_model = own
    return recipe, adapter, reward_model


def aligned_adapter(run: Optional[Path], stage: str) -> Optional[Path]:
    """The adapter of the run's finished aligned ``stage`` (rl, dpo, kto) the gate judges on top of the
    merged SFT prior; None for ``sft`` (the prior itself)."""
    if stage not in GATE_STAGES:
        raise UserError(f"--stage {stage}: choose {', '.join(GATE_STAGES)}")
    if stage == "sft":
        return None
    if run is None:
        raise UserError(f"--stage {stage} judges a run's {stage} policy: pass --run RUN")
    if read_manifest(Path(run) / stage) is None or not (Path(run) / stage / "adapter").is_dir():
        raise UserError(f"run {run} has no finished {stage} stage (no {stage}/manifest.json); train it first "
                        "or judge --stage sft")
    return Path(run) / stage / "adapter"


def gate_inputs(recipe: Recipe, run: Optional[Path], adapter: Optional[Path], reward_model: Optional[Path],
                rewards: Sequence[str]) -> dict:
    """Everything the gate's figures depend on, earlier stages named by their content (not their
    paths): a report measured with the same inputs is reused (:func:`reusable_report`)."""
    data = recipe.data
    prior = {"model": resolve_source(recipe.model.source).ref}
    if adapter is not None:
        prior = {"sft": stage_identity(adapter.parent)}
    tasks = None
    if data.tasks is not None:
        tasks = fingerprint(Path(data.tasks))
    reward_stage = None
    if run is not None:
        reward_stage = stage_identity(Path(run) / "reward")  # its held-out pairs measure the reward model
    return {"prior": prior, "reward_model": artifact_digest(reward_model) if reward_model is not None else None,
            "reward_stage": reward_stage, "rewards": list(rewards), "source": source_fingerprint(data),
            "data": data.model_dump(exclude={"path", "tasks"}), "tasks": tasks, "seed": recipe.seed,
            "headroom": recipe.headroom.model_dump(), "group_size": recipe.rl.group_size,
            "temperature": spread_temperature(recipe),
            "episodes": recipe.rl.model_dump(include={"episodes", "max_tool_rounds", "environment"})}


def reusable_report(recipe: Recipe, run: Path, adapter: Optional[Path] = None, reward_model: Optional[Path] = None,
                    rewards: Sequence[str] = ()) -> Optional[dict]:
    """The run's ``headroom.json`` when it was measured with exactly these inputs, else None."""
    path = Path(run) / REPORT
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text(encoding="utf-8"))
    recipe, adapter, reward_model = gate_subject(recipe, run, adapter, reward_model, rewards)
    if recorded.get("inputs_hash") != digest(gate_inputs(recipe, run, adapter, reward_model, rewards)):
        return None
    del recorded["inputs_hash"]  # the report as check_headroom returns it
    recorded.pop("request", None)
    return recorded


def check_headroom(recipe: Recipe, run: Optional[Path] = None, adapter: Optional[Path] = None,
                   reward_model: Optional[Path] = None, rewards: Sequence[str] = (),
                   stage: str = "sft") -> HeadroomReport:
    """Measure the gate's figures; writes nothing (``train``'s gate records its report in the run:
    :func:`record_report`).

    Perplexity always; reward accuracy when a reward model is known (``reward_model``, or the run's
    ``reward/model`` when no ``rewards`` are given either); reward spread when any reward is known.
    ``stage`` judges the SFT prior (``sft``, what ``train`` gates) or a finished aligned stage's
    policy (``rl``, ``dpo``, ``kto``: its adapter on the merged SFT prior).
    """
    started = time.time()
    device = resolve_device(recipe.compute.device)
    aligned = aligned_adapter(run, stage)
    recipe, adapter, reward_model = gate_subject(recipe, run, adapter, reward_model, rewards)
    # environments named by rows: allowed ones only, before any import
    check_task_file(recipe.rl, recipe.data.tasks)
    for given in (adapter, aligned):
        if given is not None:
            require_adapter(given, recipe.model.allow_pickle)  # before anything loads
    model_source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(model_source, recipe.model.trust_remote_code)
    corpus = load_corpus(recipe.data, recipe.seed)
    source = prompt_source(recipe, tokenizer, corpus)
    documents = _perplexity_documents(recipe, corpus, source)
    encoded = encode_all(documents, tokenizer, recipe.data.max_length)
    if not encoded:
        raise UserError(f"data {corpus.description}: no eval document has tokens to score")
    reward_known = reward_model is not None or bool(rewards)
    with stage_lines("headroom gate",
                     _gate_plan(recipe, len(encoded), source, reward_known)) as lines:
        info = {"model": model_source.label, "data": corpus.description,
                "prompts": source.description, "eval_documents": len(encoded), "stage": stage}
        model = _prior(recipe, model_source, device, (adapter, aligned), encoded,
                       tokenizer.pad_token_id, info)
        measured = perplexity(model, encoded, tokenizer.pad_token_id, recipe.headroom.batch_size)
        figures = [Figure("held-out perplexity",
                          measured.ppl, recipe.headroom.max_ppl, "<", REMEDY_PPL)]
        if reward_known:
            given = GateReward(reward_model, rewards, run)
            figures += _reward_figures(recipe, corpus, source, model, tokenizer, given, info)
        else:
            info["reward"] = ("not measured: no reward model or reward function "
                              "(slm-align train --stage reward)")
        info.update(eval_tokens=measured.tokens, seconds=round(time.time() - started, 2))
        report = HeadroomReport(figures, info)
        lines.figures = report.summary()
    return report


def record_report(report: dict, recipe: Recipe, run: Path, adapter: Optional[Path],
                  reward_model: Optional[Path], rewards: Sequence[str]) -> None:
    """Write ``run/headroom.json``: the report of ``train``'s gate, the hash of its inputs
    (:func:`reusable_report`) and what it measured (:func:`gate_request`, which ``check-headroom
    --run`` measures again)."""
    subject, adapter, reward_model = gate_subject(recipe, run, adapter, reward_model, rewards)
    inputs = gate_inputs(subject, run, adapter, reward_model, rewards)
    record = dict(report, inputs_hash=digest(inputs), request=gate_request(subject, run, reward_model, rewards))
    write_json_atomic(Path(run) / REPORT, record)


REQUEST_RL = ("from_sft", "episodes", "max_tool_rounds", "environment", "group_size", "temperature")
"""The RL settings the gate's measurement depends on (episodes or completions, the advice's group, the
spread's temperature)."""
REQUEST_PATHS = ("data.tasks", "data.path", "model.source")


def _where(path, run: Path) -> str:
    """A path as the record keeps it: relative to the run when inside it (it moves with the run), else
    absolute; a name that is no file (a hub id, ``demo``) as given."""
    given = Path(path)
    if not given.exists():
        return str(path)
    resolved = given.resolve()
    if resolved.is_relative_to(Path(run).resolve()):
        return resolved.relative_to(Path(run).resolve()).as_posix()
    return str(resolved)


def _recorded_path(value: Optional[str], run: Path) -> Optional[str]:
    """A recorded path back: inside the run when it is there, else as recorded."""
    if value is None:
        return None
    inside = Path(run) / value
    return str(inside) if inside.exists() else value


def gate_request(recipe: Recipe, run: Path, reward_model: Optional[Path], rewards: Sequence[str]) -> dict:
    """What the gate measured, as recipe settings (dotted keys), reward specs and reward model:
    ``check-headroom --run`` measures the same (:func:`as_recorded`). With ``rl.from_sft`` the run's
    SFT stage names the model, seed and corpus; without it, the record does."""
    settings: dict = {f"rl.{key}": getattr(recipe.rl, key) for key in REQUEST_RL}
    settings.update({f"headroom.{key}": value for key, value in recipe.headroom.model_dump(mode="json").items()})
    if recipe.data.tasks is not None:
        settings["data.tasks"] = _where(recipe.data.tasks, run)
    if not recipe.rl.from_sft:
        if recipe.model.source is not None:  # None: the bundled model
            settings["model.source"] = _where(recipe.model.source, run)
        settings["seed"] = recipe.seed
        data = recipe.data.model_dump(mode="json", exclude={"tasks", "path"})
        settings.update({f"data.{key}": value for key, value in data.items()})
        if recipe.data.path is not None:
            settings["data.path"] = _where(recipe.data.path, run)
    model = None if reward_model is None else _where(reward_model, run)
    return {"settings": settings, "rewards": list(rewards), "reward_model": model}


def as_recorded(run: Path, overrides: dict, rewards: Sequence[str],
                reward_model: Optional[Path]) -> tuple[dict, list[str], Optional[Path], Optional[dict]]:
    """What ``check-headroom --run`` measures: the request ``train``'s gate recorded in the run's
    ``headroom.json`` (its tasks, rewards, reward model, episode and gate settings), under what the
    user gave. ``overrides`` are recipe settings (None: not given); ``--reward`` or ``--reward-model``
    replace the recorded reward as a whole, as ``train`` takes them. Returns the settings, reward
    specs, reward model and the request (None when the run records none: the flags alone)."""
    path = Path(run) / REPORT
    request = None
    if path.is_file():
        request = json.loads(path.read_text(encoding="utf-8")).get("request")
    if request is None:
        return overrides, list(rewards), reward_model, None
    merged = dict(overrides)
    for key, value in request["settings"].items():
        if merged.get(key) is None:
            merged[key] = _recorded_path(value, run) if key in REQUEST_PATHS else value
    if not rewards and reward_model is None:
        rewards = request["rewards"]
        recorded = _recorded_path(request["reward_model"], run)
        reward_model = None if recorded is None else Path(recorded)
    return merged, list(rewards), reward_model, request
