"""Did alignment help? Compare policies on held-out prompts under one shared
reward, with the statistics.

Every policy samples the same prompts with the same settings and seed; the first policy (the SFT
prior by default) is the baseline every other one is compared with. Output: ``eval/report.md``,
``eval/report.json``, ``eval/reward_distributions.png`` and, when the run has RL metrics,
``eval/training_curves.png``.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from slm_align.atomic import write_json_atomic, write_text_atomic
from slm_align.config import Recipe
from slm_align.config.from_sft import recipe_from_sft
from slm_align.data.corpus import load_corpus
from slm_align.data.encoding import encode_all
from slm_align.data.prompt_source import prompt_source
from slm_align.envelope.recovery import read_events
from slm_align.envelope.watchdog_text import report_section
from slm_align.errors import UserError
from slm_align.modeling.accelerator import resolve_device
from slm_align.modeling.generation import sample, score
from slm_align.modeling.models import (
    load_adapter,
    load_model,
    load_tokenizer,
    merged_policy,
    require_adapter,
    resolve_source,
)
from slm_align.plots import plot_curves
from slm_align.progress import stage_lines
from slm_align.runs import ALIGNED_STAGES, read_manifest
from slm_align.scoring.learned_reward import learned_reward
from slm_align.scoring.perplexity import perplexity
from slm_align.stats import (
    analytical_win_rate,
    bootstrap_ci,
    distinct_n,
    mean_delta,
    paired_win_rate,
    sign_flip_p_value,
)


@dataclass
class Policy:
    """A named policy and how to load it (model, tokenizer) when its turn comes."""

    name: str
    describe: str
    load: Callable


def run_policies(recipe: Recipe, run: Path, adapter: Optional[Path], baselines: Sequence[str]) -> list[Policy]:
    """The run's SFT prior (the model as given when ``adapter`` is None), its RL, DPO and KTO
    policies when present, then any baseline model sources. Every adapter is checked before any
    policy loads (a pickle-only one needs ``model.allow_pickle``)."""
    source = resolve_source(recipe.model.source)
    model = recipe.model
    stages = [stage for stage in ALIGNED_STAGES if (Path(run) / stage / "adapter").is_dir()]
    adapters = ([adapter] if adapter is not None else []) + [Path(run) / stage / "adapter" for stage in stages]
    for directory in adapters:
        require_adapter(directory, model.allow_pickle)

    def load_sft():
        policy = merged_policy(source, adapter, model.trust_remote_code, model.allow_pickle)
        return policy, load_tokenizer(source, model.trust_remote_code)

    def load_aligned(stage: str):
        policy, tokenizer = load_sft()
        return load_adapter(policy, Path(run) / stage / "adapter", model.allow_pickle), tokenizer

    policies = [Policy("sft", f"{source.label} + SFT adapter", load_sft)]
    if adapter is None:  # RL started from the model as given (--no-sft)
        policies = [Policy("base", f"{source.label} as given", load_sft)]
    for stage in stages:
        describe = f"{policies[0].name} + {stage.upper()} adapter"
        policies.append(Policy(stage, describe, functools.partial(load_aligned, stage)))
    for spec in baselines:
        baseline = resolve_source(spec)
        policies.append(Policy(baseline.label, baseline.label, functools.partial(_load_source, baseline, recipe)))
    return policies


def _load_source(source, recipe: Recipe):
    """A baseline model and its tokenizer, as they are (no adapter)."""
    model = load_model(source, recipe.model.trust_remote_code, recipe.model.allow_pickle)
    return model, load_tokenizer(source, recipe.model.trust_remote_code)


def _measure(policy: Policy, prompts: list[str], documents, reward, recipe: Recipe, max_new_tokens: int,
             temperature: float, device: str = "cpu") -> dict:
    with stage_lines("evaluation", f"{policy.name} on {len(prompts)} prompts and "
                                   f"{len(documents)} documents") as stage:
        model, tokenizer = policy.load()
        model = model.to(device)
        samples = sample(model, tokenizer, prompts, max_new_tokens, temperature, seed=recipe.seed)
        scores = score(reward, samples)
        encoded = encode_all(documents, tokenizer, recipe.data.max_length)
        ppl = perplexity(model, encoded, tokenizer.pad_token_id, recipe.headroom.batch_size).ppl
        row = _row(policy, samples, scores, ppl)
        stage.figures = (f"{policy.name}: reward mean {row['reward_mean']:.3f} (std "
                         f"{row['reward_std']:.3f}), perplexity {ppl:.3f}")
    return row


def _row(policy: Policy, samples, scores: list[float], ppl: float) -> dict:
    """One policy's figures in the report."""
    lengths = samples.completion_mask.sum(-1).float()
    return {"name": policy.name, "model": policy.describe, "ppl": ppl,
            "reward_mean": statistics.fmean(scores), "reward_std": statistics.pstdev(scores),
            "distinct_1": distinct_n(samples.completions, 1), "distinct_2": distinct_n(samples.completions, 2),
            "length": float(lengths.mean()), "truncated_frac": sum(samples.truncated) / len(scores),
            "rewards": scores, "completions": samples.completions}


def compare(a: dict, b: dict, seed: int) -> dict:
    """b against a on the same prompts: delta and paired win rate with 95% bootstrap
    intervals, and a test."""
    ra = a["rewards"]
    rb = b["rewards"]
    delta = mean_delta(ra, rb)
    delta_ci = bootstrap_ci(ra, rb, mean_delta, seed=seed)
    verdict = "no significant change"
    if delta_ci[0] > 0 or delta_ci[1] < 0:
        verdict = "significant gain" if delta > 0 else "significant drop"
    return {"baseline": a["name"], "policy": b["name"], "delta": delta, "delta_ci95": delta_ci,
            "win_rate": paired_win_rate(ra, rb), "win_rate_ci95": bootstrap_ci(ra, rb, paired_win_rate, seed=seed),
            "analytical_win_rate": analytical_win_rate(delta, a["reward_std"], b["reward_std"]),
            "p_value": sign_flip_p_value(ra, rb, seed=seed), "verdict": verdict}


def evaluate(recipe: Recipe, run: Path, baselines: Sequence[str] = (),
             reward_model: Optional[Path] = None, rewards: Sequence[str] = (), prompts: int = 200,
             sft_run: Optional[Path] = None) -> dict:
    """Measure every policy, compare each with the first, and write the report into ``run/eval/``.

    Completions are sampled as the recipe says (``rl.max_new_tokens``, ``rl.temperature``).
    ``sft_run`` names the run whose SFT stage is the prior when it is not ``run`` itself
    (``train --sft``).
    """
    run = Path(run)
    device = resolve_device(recipe.compute.device)
    adapter = None
    if _starts_from_sft(recipe, run, sft_run):
        recipe, adapter = recipe_from_sft(sft_run or run, recipe)
    if reward_model is None and (run / "reward" / "model").is_dir():
        reward_model = run / "reward" / "model"
    corpus = load_corpus(recipe.data, recipe.seed)
    splits = corpus.splits
    tokenizer = load_tokenizer(resolve_source(recipe.model.source), recipe.model.trust_remote_code)
    source = prompt_source(recipe, tokenizer, corpus)
    reward = source.reward(rewards, learned=learned_reward(reward_model, device))
    held = source.heldout[:prompts]
    if len(held) < 2:
        raise UserError("fewer than two held-out prompts to evaluate on; give a larger corpus")
    documents = splits.eval[: recipe.headroom.max_documents]
    max_new = recipe.rl.max_new_tokens
    temp = recipe.rl.temperature
    rows = [_measure(p, held, documents, reward, recipe, max_new, temp, device)
            for p in run_policies(recipe, run, adapter, baselines)]
    shown = min(3, len(held))  # --prompts may be 2
    samples = [{"prompt": held[i], **{r["name"]: r["completions"][i] for r in rows}}
               for i in range(shown)]
    report = {"prompts": len(held), "max_new_tokens": max_new, "temperature": temp,
              "seed": recipe.seed, "reward_terms": [name for name, _, _ in reward.terms],
              "policies": rows,
              "comparisons": [compare(rows[0], row, recipe.seed) for row in rows[1:]],
              "samples": samples}
    report["watchdog"] = _watchdog_of(run / "rl")
    report["preference"] = preference_records(run)
    _write(report, run / "eval", run / "rl" / "metrics.jsonl")
    return report


def _watchdog_of(stage: Path) -> Optional[dict]:
    """The RL stage's watchdog record and events (None without a finished RL stage)."""
    manifest = read_manifest(stage)
    if manifest is None or "watchdog" not in manifest["metrics"]:
        return None
    return dict(manifest["metrics"]["watchdog"], event_list=read_events(stage / "events.jsonl"))


def preference_records(run: Path) -> list[dict]:
    """The held-out preference accuracy (with its 95% interval) of each finished DPO/KTO
    stage, before and after."""
    records = []
    for stage in ("dpo", "kto"):
        manifest = read_manifest(Path(run) / stage)
        if manifest is None or manifest["metrics"].get("heldout_accuracy") is None:
            continue
        metrics = manifest["metrics"]
        headline = metrics["heldout_accuracy"]
        records.append({"stage": stage, "kind": headline["kind"], "before": metrics["heldout_before"][headline["kind"]],
                        "after": headline["value"], "ci95": headline["ci95"], "steps": metrics["steps"],
                        "heldout_pairs": metrics["heldout_pairs"]})
    return records


def preference_section(records: list[dict]) -> list[str]:
    """The report's markdown lines for :func:`preference_records` (none without a DPO/KTO stage)."""
    if not records:
        return []
    lines = ["## Preference optimisation", "",
             "| stage | held-out accuracy before | after | 95% CI | held-out pairs | steps |",
             "|---|---|---|---|---|---|"]
    for r in records:
        low = r["ci95"][0]
        high = r["ci95"][1]
        lines.append(f"| {r['stage']} ({r['kind'].replace('_', ' ')}) | {r['before']:.3f} | "
                     f"{r['after']:.3f} | [{low:.3f}, {high:.3f}] | "
                     f"{r['heldout_pairs']} | {r['steps']} |")
    lines += ["", "Pair accuracy: share of held-out pairs whose implicit reward beta * log(pi / "
              "pi_ref) is higher for the chosen answer (0 before training: the policy equals the "
              "reference); interval: Wilson.", ""]
    return lines


def _starts_from_sft(recipe: Recipe, run: Path, sft_run: Optional[Path]) -> bool:
    """Whether the run's prior is an SFT adapter: not when RL was asked to start from the model as
    given, or when the run has no SFT stage and its RL stage recorded none."""
    if sft_run is not None:
        return True
    if not recipe.rl.from_sft:
        return False
    rl = read_manifest(run / "rl")
    return not (read_manifest(run / "sft") is None and rl is not None and rl["inputs"].get("sft") is None)


def _write(report: dict, out: Path, metrics: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "report.json", report)
    _plot_rewards(report, out / "reward_distributions.png")
    if metrics.is_file():
        events = (report.get("watchdog") or {}).get("event_list", [])
        plot_curves(metrics, out / "training_curves.png", events=events)
    write_text_atomic(out / "report.md", render_markdown(report, has_curves=metrics.is_file()))


def _plot_rewards(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for row in report["policies"]:
        ax.hist(row["rewards"], bins=20, alpha=0.5, label=f"{row['name']} (mean "
                f"{row['reward_mean']:.2f})")
    ax.set_xlabel("reward")
    ax.set_ylabel("prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def summary_line(comparison: dict) -> str:
    c = comparison
    low, high = c["delta_ci95"]
    wl, wh = c["win_rate_ci95"]
    return (f"{c['policy']} vs {c['baseline']}: reward delta {c['delta']:+.3f} [95% CI {low:+.3f}, "
            f"{high:+.3f}], win rate {c['win_rate']:.1%} [{wl:.1%}, {wh:.1%}] (analytical "
            f"{c['analytical_win_rate']:.1%}), p = {c['p_value']:.3g}: {c['verdict']}")


def render_markdown(report: dict, has_curves: bool) -> str:
    lines = ["# Evaluation report", "",
             f"{report['prompts']} held-out prompts, one sample each, temperature "
             f"{report['temperature']}, {report['max_new_tokens']} new tokens, seed "
             f"{report['seed']}; reward: {' + '.join(report['reward_terms'])}.", "",
             "| policy | held-out PPL | reward mean | reward std | distinct-1 | distinct-2 | "
             "length | truncated |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["policies"]:
        lines.append(f"| {r['name']} | {r['ppl']:.3f} | {r['reward_mean']:.3f} | "
                     f"{r['reward_std']:.3f} | {r['distinct_1']:.3f} | {r['distinct_2']:.3f} | "
                     f"{r['length']:.1f} | {r['truncated_frac']:.1%} |")
    lines += ["", "## Comparisons", ""] + [f"- {summary_line(c)}" for c in report["comparisons"]]
    lines += ["", "A delta whose 95% interval includes zero is reported as no significant change. "
              "Win rate: share of prompts where the policy's reward beats the baseline's (ties "
              "half); analytical: Phi(delta / sqrt(std_a^2 + std_b^2)) as in published tables; p: "
              "paired sign-flip test.", "",
              "## Samples", ""]
    for s in report["samples"]:
        lines.append(f"**Prompt:** {s['prompt']}")
        lines += [f"- *{name}*: {text.strip()[:300]}" for name, text in s.items() if name != "prompt"]
        lines.append("")
    watchdog = report.get("watchdog")
    lines += report_section(watchdog, (watchdog or {}).get("event_list", []))
    lines += preference_section(report.get("preference", []))
    lines += ["## Plots", "", "![reward distributions](reward_distributions.png)"]
    if has_curves:
        lines.append("![training curves](training_curves.png)")
    return "\n".join(lines) + "\n"
