"""The ``slm-align`` command line. Thin: parse, call one function, print."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table
from typer.exceptions import TyperException

from slm_align.errors import EXIT_USER_ERROR, UserError, storage_error

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Align small language models safely and ship them to phones and CPU boards.")
stdout = Console()

JsonFlag = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout.")
ConfigOpt = typer.Option(None, "--config", help="TOML recipe; flags override it.")
ModelOpt = typer.Option(None, "--model", "-m", help="HF directory, hub id or .gguf file (default: bundled model).")
DataOpt = typer.Option(None, "--data", "-d", help="Corpus: .txt/.jsonl/.json/.csv/.parquet or a datasets dir "
                                                  "(default: demo stories).")
TextFieldOpt = typer.Option(None, "--text-field", help="Column holding the text (found automatically otherwise).")
SeedOpt = typer.Option(None, "--seed", help="Seed for split, initialisation and data order (default 0).")
TrustOpt = typer.Option(False, "--trust-remote-code", help="Allow code shipped with a hub model to run.")
PickleOpt = typer.Option(False, "--allow-pickle", help="Accept pickle (.bin) weights; they can run code.")


def emit(as_json: bool, result: dict, human: Callable[[], None]) -> None:
    """Print ``result`` as JSON, or call ``human`` to print it for people."""
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
    else:
        human()


def _recipe(config: Optional[Path], **overrides: Any):
    from slm_align.config import load_recipe

    return load_recipe(config, overrides)


def _common(model, data, text_field, seed, trust, allow_pickle) -> dict:
    return {"model.source": model, "data.path": data, "data.text_field": text_field, "seed": seed,
            "model.trust_remote_code": trust or None, "model.allow_pickle": allow_pickle or None}


@app.command(epilog="Examples:\n\n  slm-align sft --data stories.txt --out runs/demo\n\n"
                    "  slm-align sft --model ./SmolLM2-135M --data chat.jsonl --lora-r 32 --epochs 2 --out runs/chat\n\n"
                    "  slm-align sft --out runs/demo --resume   # continue an interrupted run")
def sft(
    out: Path = typer.Option(Path("runs/default"), "--out", "-o", help="Run directory; SFT writes OUT/sft/."),
    model: Optional[str] = ModelOpt, data: Optional[str] = DataOpt, text_field: Optional[str] = TextFieldOpt,
    config: Optional[Path] = ConfigOpt, seed: Optional[int] = SeedOpt,
    epochs: Optional[float] = typer.Option(None, help="Passes over the training split (default 1)."),
    max_steps: Optional[int] = typer.Option(None, help="Stop after this many optimizer steps."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default 2e-3)."),
    batch_size: Optional[int] = typer.Option(None, help="Sequences per batch (default 8)."),
    grad_accum: Optional[int] = typer.Option(None, help="Batches per optimizer step (default 1)."),
    warmup_ratio: Optional[float] = typer.Option(None, help="Share of steps warming up (default 0.05)."),
    neftune_alpha: Optional[float] = typer.Option(None, help="NEFTune noise scale, 0 to disable (default 5)."),
    lora_r: Optional[int] = typer.Option(None, help="LoRA rank (default 16)."),
    lora_alpha: Optional[float] = typer.Option(None, help="LoRA alpha (default 32)."),
    lora_dropout: Optional[float] = typer.Option(None, help="LoRA dropout (default 0.05)."),
    lora_targets: Optional[str] = typer.Option(None, help="Comma-separated module names to adapt."),
    max_length: Optional[int] = typer.Option(None, help="Tokens per sequence (default 256)."),
    save_steps: Optional[int] = typer.Option(None, help="Checkpoint every N steps (default 50)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted SFT run in OUT."),
    trust_remote_code: bool = TrustOpt, allow_pickle: bool = PickleOpt, as_json: bool = JsonFlag,
) -> None:
    """Supervised fine-tuning with LoRA and NEFTune; writes the adapter, tokenizer and a manifest."""
    from slm_align.sft import run_sft

    recipe = _recipe(config, **_common(model, data, text_field, seed, trust_remote_code, allow_pickle),
                     **{"sft.epochs": epochs, "sft.max_steps": max_steps, "sft.learning_rate": lr,
                        "sft.batch_size": batch_size, "sft.grad_accum": grad_accum, "sft.warmup_ratio": warmup_ratio,
                        "sft.neftune_alpha": neftune_alpha, "sft.lora.r": lora_r, "sft.lora.alpha": lora_alpha,
                        "sft.lora.dropout": lora_dropout, "data.max_length": max_length, "sft.save_steps": save_steps,
                        "sft.lora.target_modules": lora_targets.split(",") if lora_targets else None})
    result = run_sft(recipe, out, resume=resume)
    summary = result.summary()
    emit(as_json, summary, lambda: print_sft(summary))


def print_sft(summary: dict) -> None:
    m = summary["metrics"]
    state = "already done with these inputs (skipped)" if summary["skipped"] else f"{m['steps']} steps"
    stdout.print(f"[bold]SFT[/] -> {summary['dir']}: {state}; train loss {m['train_loss']:.3f}, "
                 f"eval loss {m['eval_loss']:.3f}, {m['trainable_parameters']:,} trainable parameters")


@app.command("check-headroom",
             epilog="Exit code 0 on PASS, 1 on FAIL, 2 on bad input.\n\nExamples:\n\n"
                    "  slm-align check-headroom --run runs/demo\n\n"
                    "  slm-align check-headroom --model ./base --adapter runs/demo/sft/adapter --data eval.jsonl\n\n"
                    "  slm-align check-headroom --run runs/demo --max-ppl 15 --json\n\n"
                    "  slm-align check-headroom --run runs/demo --reward mypkg.rewards:politeness@0.5")
def check_headroom_cmd(
    run: Optional[Path] = typer.Option(None, "--run", "-r", help="Run directory with a finished SFT stage."),
    model: Optional[str] = ModelOpt,
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="SFT adapter directory (with --model)."),
    data: Optional[str] = DataOpt, text_field: Optional[str] = TextFieldOpt, config: Optional[Path] = ConfigOpt,
    seed: Optional[int] = SeedOpt,
    max_ppl: Optional[float] = typer.Option(None, "--max-ppl", help="Perplexity threshold (default 20)."),
    reward_model: Optional[Path] = typer.Option(None, help="Reward model dir (default: the run's reward/model)."),
    reward: list[str] = typer.Option([], "--reward", help="Reward function module:function[@weight] or a built-in "
                                                          "(length_window, exact_answer, json_tool_call); repeatable."),
    min_reward_acc: Optional[float] = typer.Option(None, help="Minimum held-out pairwise accuracy (default 0.6)."),
    min_reward_std: Optional[float] = typer.Option(None, help="Minimum reward std over samples (default 0.1)."),
    trust_remote_code: bool = TrustOpt, allow_pickle: bool = PickleOpt, as_json: bool = JsonFlag,
) -> None:
    """Measure whether RL has headroom: SFT perplexity, reward accuracy and reward spread against thresholds."""
    from slm_align.headroom import check_headroom

    if run is not None and model is not None:
        raise UserError("pass either --run or --model, not both")
    recipe = _recipe(config, **_common(model, data, text_field, seed, trust_remote_code, allow_pickle),
                     **{"headroom.max_ppl": max_ppl, "headroom.min_reward_accuracy": min_reward_acc,
                        "headroom.min_reward_std": min_reward_std})
    report = check_headroom(recipe, run=run, adapter=adapter, reward_model=reward_model, rewards=reward)
    emit(as_json, report.to_dict(), lambda: print_headroom(report.to_dict()))
    raise typer.Exit(0 if report.passed else 1)


def print_headroom(report: dict) -> None:
    table = Table(title="Headroom gate")
    for column in ("figure", "value", "threshold", "result"):
        table.add_column(column)
    for f in report["figures"]:
        table.add_row(f["name"], f"{f['value']:.3f}", f"{f['comparison']} {f['threshold']:g}",
                      "[green]pass[/]" if f["passed"] else "[red]FAIL[/]")
    info = report["info"]
    if "base_ppl" in info:
        table.add_row("base model perplexity (context)", f"{info['base_ppl']:.3f}", "", "")
    for key in ("reward", "reward_accuracy", "reward_spread"):
        if key in info:
            table.add_row(key.replace("_", " "), info[key], "", "")
    stdout.print(table)
    color = "green" if report["passed"] else "red"
    stdout.print(f"verdict: [bold {color}]{report['verdict']}[/]")
    for reason, remedy in zip(report["reasons"], report["remedies"]):
        stdout.print(f"  {reason}: {remedy}")


@app.command(epilog="Examples:\n\n  slm-align quickstart\n\n  slm-align quickstart --out runs/qs --json")
def quickstart(
    out: Path = typer.Option(Path("runs/quickstart"), "--out", "-o", help="Run directory."),
    sft_steps: int = typer.Option(150, min=1, help="SFT optimizer steps on the bundled model."),
    reward_steps: int = typer.Option(100, min=1, help="Reward-model optimizer steps."),
    rl_steps: int = typer.Option(20, min=1, help="PPO iterations."),
    as_json: bool = JsonFlag,
) -> None:
    """Walk the loop on the bundled model and demo stories, printing each stage's figures."""
    from slm_align.quickstart import run_quickstart

    result = run_quickstart(out, sft_steps=sft_steps, reward_steps=reward_steps, rl_steps=rl_steps,
                            say=None if as_json else stdout.print)
    emit(as_json, result, lambda: None)
    raise typer.Exit(0 if result["headroom"]["passed"] else 1)


def _pair_mix(text: Optional[str]) -> Optional[dict]:
    if text is None:
        return None
    mix = {}
    for item in text.split(","):
        name, _, weight = item.partition("=")
        try:
            mix[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise UserError(f"--pair-mix {text}: weight {weight!r} is not a number (e.g. truncate=1,shuffle=2)") from None
    return mix


@app.command(epilog="Examples:\n\n  slm-align train --algo grpo --out runs/demo          # SFT, reward model, gate, GRPO\n\n"
                    "  slm-align train --algo ppo --out runs/demo --steps 100 --kl-coef 0.1\n\n"
                    "  slm-align train --algo grpo --sft runs/base --reward-model rm/ --reward my_rewards:fn@0.5 --out runs/g\n\n"
                    "  slm-align train --stage reward --out runs/demo --preferences prefs.jsonl --pair-mix shuffle=2,truncate=1\n\n"
                    "  slm-align train --out runs/demo --resume              # continue a killed run\n\n"
                    "  slm-align train --out runs/demo --force               # train although the gate says FAIL (recorded)")
def train(
    out: Path = typer.Option(Path("runs/default"), "--out", "-o", help="Run directory."),
    stage: str = typer.Option("rl", help="sft, reward, or rl (runs the stages it needs, the gate, then RL)."),
    algo: Optional[str] = typer.Option(None, help="RL algorithm: ppo (default) or grpo."),
    model: Optional[str] = ModelOpt, data: Optional[str] = DataOpt, text_field: Optional[str] = TextFieldOpt,
    config: Optional[Path] = ConfigOpt, seed: Optional[int] = SeedOpt,
    sft_from: Optional[Path] = typer.Option(None, "--sft", help="Take the finished SFT stage of this run instead."),
    reward_model: Optional[Path] = typer.Option(None, help="Use this reward model dir instead of training one."),
    reward: list[str] = typer.Option([], "--reward", help="Reward function module:function[@weight] or a built-in; "
                                                          "repeatable; added to the reward model."),
    force: bool = typer.Option(False, "--force", help="Train even when the headroom gate says FAIL (recorded)."),
    preferences: list[str] = typer.Option([], help="Preference file (TRL columns) for the reward model; repeatable "
                                                   "(give both files of `feedback export`)."),
    pair_mix: Optional[str] = typer.Option(None, help="Corruption weights, e.g. truncate=1,shuffle=1,mismatch=1,dropout=1."),
    no_synthetic_pairs: bool = typer.Option(False, "--no-synthetic-pairs", help="Train on --preferences only."),
    reward_steps: Optional[int] = typer.Option(None, help="Reward-model optimizer steps (default: one epoch)."),
    reward_lr: Optional[float] = typer.Option(None, help="Reward-model learning rate (default 1e-3)."),
    margin: Optional[float] = typer.Option(None, help="Bradley-Terry margin (default 0)."),
    center: Optional[float] = typer.Option(None, help="Reward-centering coefficient (default 0.01)."),
    steps: Optional[int] = typer.Option(None, help="RL iterations (default 40)."),
    rl_lr: Optional[float] = typer.Option(None, help="RL learning rate (default: by model size, 1e-3 at 2.5M to 1.5e-5 at 500M)."),
    prompts_per_step: Optional[int] = typer.Option(None, help="Prompts per iteration (default 4; PPO: x group size)."),
    group_size: Optional[int] = typer.Option(None, help="GRPO group size G (default 8)."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens per completion (default 48)."),
    kl_coef: Optional[float] = typer.Option(None, help="PPO KL coefficient (default 0.05)."),
    kl_mode: Optional[str] = typer.Option(None, help="PPO KL: reward (k1 in the reward) or loss (k3 in the loss)."),
    adaptive_kl: bool = typer.Option(False, "--adaptive-kl", help="PPO: adapt the KL coefficient."),
    beta: Optional[float] = typer.Option(None, help="GRPO k3 KL coefficient (default 0.04)."),
    loss_type: Optional[str] = typer.Option(None, help="GRPO loss: grpo, dr_grpo or token_mean."),
    scale_rewards: Optional[str] = typer.Option(None, help="GRPO advantage scale: group, batch or none."),
    resample_zero_std: bool = typer.Option(False, "--resample-zero-std", help="GRPO: resample all-equal groups."),
    mask_truncated: bool = typer.Option(False, "--mask-truncated", help="No gradient from truncated completions."),
    length_penalty: Optional[float] = typer.Option(None, help="Soft penalty per token past 80% of the budget."),
    no_reinit_lora: bool = typer.Option(False, "--no-reinit-lora", help="ENVELOPE OFF: keep the SFT adapter as loaded."),
    no_ratio_guard: bool = typer.Option(False, "--no-ratio-guard", help="ENVELOPE OFF: never skip on the ratio."),
    no_rollback: bool = typer.Option(False, "--no-rollback", help="ENVELOPE OFF: no snapshot/rollback on NaN."),
    sigma_clip: Optional[float] = typer.Option(None, help="Sigma clip of scores/advantages (default 3; 0: off)."),
    grad_clip: Optional[float] = typer.Option(None, help="Gradient-norm clip (default 1; 0: off)."),
    report_prompts: Optional[int] = typer.Option(None, help="Held-out prompts of the closing evaluation report "
                                                            "(default 200; 0: none)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted stage in OUT."),
    trust_remote_code: bool = TrustOpt, allow_pickle: bool = PickleOpt, as_json: bool = JsonFlag,
) -> None:
    """Train: SFT, the Bradley-Terry reward model, the headroom gate, then PPO or GRPO in the safety envelope."""
    from slm_align.reward.stage import run_reward
    from slm_align.rl.stage import run_rl
    from slm_align.sft import run_sft

    if stage not in ("sft", "reward", "rl"):
        raise UserError(f"--stage {stage}: choose sft, reward or rl")
    off = lambda flag: False if flag else None  # noqa: E731
    recipe = _recipe(config, **_common(model, data, text_field, seed, trust_remote_code, allow_pickle),
                     **{"reward.preferences": preferences or None, "reward.pairs.mix": _pair_mix(pair_mix),
                        "reward.pairs.synthetic": off(no_synthetic_pairs), "reward.max_steps": reward_steps,
                        "reward.learning_rate": reward_lr, "reward.margin": margin, "reward.center_coefficient": center,
                        "rl.algo": algo, "rl.steps": steps, "rl.learning_rate": rl_lr, "rl.report_prompts": report_prompts,
                        "rl.prompts_per_step": prompts_per_step, "rl.group_size": group_size,
                        "rl.max_new_tokens": max_new_tokens, "rl.kl_coef": kl_coef, "rl.kl_mode": kl_mode,
                        "rl.adaptive_kl": adaptive_kl or None, "rl.beta": beta, "rl.loss_type": loss_type,
                        "rl.scale_rewards": scale_rewards, "rl.resample_zero_std": resample_zero_std or None,
                        "rl.mask_truncated": mask_truncated or None, "rl.length_penalty": length_penalty,
                        "rl.envelope.reinit_lora": off(no_reinit_lora), "rl.envelope.ratio_guard": 0.0 if no_ratio_guard else None,
                        "rl.envelope.rollback": off(no_rollback), "rl.envelope.sigma_clip": sigma_clip,
                        "rl.envelope.grad_clip": grad_clip})
    if stage == "sft":
        summary = run_sft(recipe, out, resume=resume).summary()
        emit(as_json, summary, lambda: print_sft(summary))
        return
    if stage == "reward":
        result = run_reward(recipe, out, resume=resume)
        summary = result.summary()
        emit(as_json, summary, lambda: print_reward(summary))
        return
    result = run_rl(recipe, out, resume=resume, force=force, sft_from=sft_from, reward_model=reward_model,
                    rewards=reward, say=lambda text: None if as_json else stdout.print(text))
    if not result.primary:  # other ranks of a data-parallel run: rank 0 reports
        return
    if recipe.rl.report_prompts == 0:
        summary = result.summary()
        emit(as_json, summary, lambda: print_rl(summary))
        return
    from slm_align.evaluate import evaluate as run_evaluation

    report = run_evaluation(recipe, out, sft_run=sft_from, reward_model=reward_model, rewards=reward,
                            prompts=recipe.rl.report_prompts)
    summary = dict(result.summary(), evaluation=report["comparisons"])
    emit(as_json, summary, lambda: (print_rl(summary), print_evaluation(report, out / "eval" / "report.md")))


def print_rl(summary: dict) -> None:
    m = summary["metrics"]
    state = "already done with these inputs (skipped)" if summary["skipped"] else f"{m['steps']} iterations"
    forced = " (gate FAIL overridden by --force)" if m["gate"]["forced"] else ""
    stdout.print(f"[bold]RL ({m['algo']})[/] -> {summary['dir']}: {state}{forced}; held-out reward "
                 f"{m['heldout_reward_sft']:.3f} (SFT) -> {m['heldout_reward_rl']:.3f} (RL), delta "
                 f"{m['heldout_reward_delta']:+.3f}; guard skips {m['guard']['skipped']}, rollbacks "
                 f"{m['guard']['rollbacks']}")


def print_reward(summary: dict) -> None:
    m = summary["metrics"]
    state = "already done with these inputs (skipped)" if summary["skipped"] else f"{m['steps']} steps"
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in m["accuracy_by_kind"].items())
    stdout.print(f"[bold]reward model[/] -> {summary['dir']}: {state}; held-out accuracy {m['accuracy']:.3f} "
                 f"({kinds}) on {m['pairs']} pairs, mean margin {m['mean_margin']:.2f}")


@app.command(epilog="Examples:\n\n  slm-align evaluate --run runs/demo\n\n"
                    "  slm-align evaluate --run runs/demo --model ./SmolLM2-135M-Instruct --prompts 100\n\n"
                    "  slm-align evaluate --run runs/demo --reward length_window@0.5 --json")
def evaluate(
    run: Path = typer.Option(..., "--run", "-r", help="Run directory (SFT required; RL and reward used if present)."),
    model: list[str] = typer.Option([], "--model", "-m", help="Add a baseline policy from any model source; repeatable."),
    reward_model: Optional[Path] = typer.Option(None, help="Shared reward model (default: the run's reward/model)."),
    reward: list[str] = typer.Option([], "--reward", help="Reward function module:function[@weight]; repeatable."),
    prompts: int = typer.Option(200, min=2, help="Held-out prompts to sample."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens per completion (default: the RL setting, 48)."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature (default 1.0)."),
    config: Optional[Path] = ConfigOpt, as_json: bool = JsonFlag,
) -> None:
    """Compare the SFT prior, the aligned policy and any baselines on held-out prompts; write eval/report.md."""
    from slm_align.evaluate import evaluate as run_evaluation

    recipe = _recipe(config, **{"rl.temperature": temperature, "rl.max_new_tokens": max_new_tokens})  # validated
    report = run_evaluation(recipe, run, baselines=model, reward_model=reward_model, rewards=reward,
                            prompts=prompts, max_new_tokens=max_new_tokens, temperature=temperature)
    emit(as_json, report, lambda: print_evaluation(report, Path(run) / "eval" / "report.md"))


def print_evaluation(report: dict, path: Path) -> None:
    from slm_align.evaluate import summary_line

    table = Table(title=f"Evaluation on {report['prompts']} held-out prompts")
    for column in ("policy", "PPL", "reward mean", "reward std", "distinct-2", "length", "truncated"):
        table.add_column(column)
    for r in report["policies"]:
        table.add_row(r["name"], f"{r['ppl']:.3f}", f"{r['reward_mean']:.3f}", f"{r['reward_std']:.3f}",
                      f"{r['distinct_2']:.3f}", f"{r['length']:.1f}", f"{r['truncated_frac']:.0%}")
    stdout.print(table)
    for comparison in report["comparisons"]:
        stdout.print(summary_line(comparison))
    stdout.print(f"report: {path}")


@app.command(epilog="Examples:\n\n  slm-align merge --run runs/demo                 # writes runs/demo/merged/\n\n"
                    "  slm-align merge --run runs/demo --out models/story-rl --overwrite --json")
def merge(
    run: Path = typer.Option(..., "--run", "-r", help="Run directory with a finished SFT stage (RL used if present)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default: RUN/merged)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    config: Optional[Path] = ConfigOpt, as_json: bool = JsonFlag,
) -> None:
    """Fold the SFT and RL adapters into the base weights: a plain HF directory that loads without peft."""
    from slm_align.export.merge import merge_run

    summary = merge_run(_recipe(config), run, out, overwrite).summary()
    emit(as_json, summary, lambda: stdout.print(
        f"[bold]merged[/] -> {summary['dir']}: {summary['metrics']['architecture']}, "
        f"{summary['metrics']['parameters']:,} parameters"
        + (" (ChatML chat template added)" if summary["metrics"]["default_chat_template"] else "")))


@app.command(epilog="Examples:\n\n  slm-align export runs/demo --target gguf               # Q8_0, parity-checked\n\n"
                    "  slm-align export runs/demo --target gguf --quant Q4_K_M\n\n"
                    "  slm-align export runs/demo --target onnx --device rpi5  # int8, arm64 preset\n\n"
                    "  slm-align export ./SmolLM2-135M --target onnx --quant fp32 --out exports/ --json\n\n"
                    "Exit code 1 when verification fails (nothing published unless --force).")
def export(
    source: str = typer.Argument(..., help="Run directory, merged/HF model directory, .gguf file or hub id."),
    target: str = typer.Option("gguf", "--target", "-t", help="gguf (llama.cpp) or onnx (onnxruntime)."),
    quant: Optional[str] = typer.Option(None, "--quant", "-q", help="GGUF: F32, F16, Q8_0 (ours) or Q4_0, Q4_K_M, "
                                        "Q5_K_M, Q6_K, ... (llama.cpp's quantizer). ONNX: fp32, int8, int4. "
                                        "Default: the device's, else Q8_0 / int8."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile (see `slm-align devices list`)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default RUN/export or ./export)."),
    preset: Optional[str] = typer.Option(None, help="ONNX int8 preset: arm64, avx2, avx512, avx512_vnni."),
    ort_format: bool = typer.Option(False, "--ort-format", help="ONNX: also write model.ort for mobile builds."),
    min_agreement: float = typer.Option(0.9, help="Lowest top-1 agreement with PyTorch for low-bit types."),
    threads: Optional[int] = typer.Option(None, min=1, help="Threads (default: the device's, else all cores)."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the parity check (recorded in the manifest)."),
    force: bool = typer.Option(False, "--force", help="Publish even when verification fails (recorded)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing artifact of the same name."),
    as_json: bool = JsonFlag,
) -> None:
    """Merge and export to GGUF or ONNX, quantized for a device, verified against the PyTorch model."""
    from slm_align.export.stage import ExportRequest, run_export

    request = ExportRequest(source, target=target, quant=quant, device=device, out=out, verify=not no_verify,
                            overwrite=overwrite, force=force, min_agreement=min_agreement, ort_format=ort_format,
                            threads=threads, preset=preset)
    summary = run_export(request).summary()
    emit(as_json, summary, lambda: print_export(summary))


def print_export(summary: dict) -> None:
    m = summary["metrics"]
    stdout.print(f"[bold]export[/] -> {summary['dir']}: {m['target']} {m['quant']}, {m['bytes'] / 1e6:.1f} MB, "
                 f"{m['export_seconds']:.1f} s")
    v = m["verification"]
    if v.get("skipped"):
        stdout.print("verification: [yellow]skipped (--no-verify)[/]")
        return
    greedy = (f"greedy {v['greedy_exact']}/{v['prompts']} prompts identical for 32 tokens"
              + (f" ({len(v['ties'])} near-tie)" if v["ties"] else "") + ", " if v["prompts"] else "")
    verdict = "[green]passed[/]" if v["passed"] else "[red]FAILED (published with --force)[/]"
    stdout.print(f"verification {verdict}: tokenizer {'identical' if v['tokenizer_match'] else 'DIFFERENT'}, "
                 f"{greedy}top-1 agreement {v['agreement']:.3f} over {v['agreement_positions']} tokens")


@app.command(epilog="Examples:\n\n  slm-align chat runs/demo/export/model-Q8_0.gguf --store prefs.db --consent\n\n"
                    "  slm-align chat runs/demo/export/onnx-int8 --system 'You are terse.' --tools --temperature 0\n\n"
                    "  echo 'hello' | slm-align chat model.gguf --json   # one answer per input line, as JSON\n\n"
                    "In the chat: /good /bad /compare /pick 1|2 /edit TEXT /tools /reset /save FILE /quit")
def chat(
    artifact: Path = typer.Argument(..., help="Exported model: a .gguf file or an ONNX export directory."),
    store: Optional[Path] = typer.Option(None, "--store", help="Preference database (SQLite) to record turns in."),
    consent: bool = typer.Option(False, "--consent", help="Mark recorded turns as consented for training."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    tools: bool = typer.Option(False, "--tools", help="Offer the built-in tools (calculator, clock, notes)."),
    notes: Optional[Path] = typer.Option(None, "--notes", help="Folder the notes tool may use (with --tools)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile for threads and context."),
    threads: Optional[int] = typer.Option(None, min=1, help="Threads (default: the device's, else all cores)."),
    n_ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="Context window in tokens."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(0.95, min=0.0, max=1.0, help="Nucleus sampling threshold."),
    max_tokens: int = typer.Option(256, min=1, help="Most tokens per answer."),
    seed: int = typer.Option(0, help="Sampling seed."),
    as_json: bool = JsonFlag,
) -> None:
    """Chat with an exported model in the terminal; give feedback that lands in the preference store."""
    from slm_align.agent.builtin_tools import default_tools
    from slm_align.agent.runtime import Agent
    from slm_align.agent.sampling import SamplingParams
    from slm_align.agent.terminal import chat_loop

    agent = Agent.load(artifact, device=device, threads=threads, n_ctx=n_ctx, store=store, consent=consent,
                       system=system, tools=default_tools(notes) if tools else None,
                       sampling=SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed))
    if as_json:
        for line in (line.strip() for line in sys.stdin):
            if line:
                reply = agent.chat(line)
                sys.stdout.write(json.dumps({"reply": reply.text, "tool_calls": reply.tool_calls,
                                             "turn_id": reply.turn_id, "truncated": reply.truncated}) + "\n")
        return
    err = Console(stderr=True)
    chat_loop(agent, (line for line in iter(lambda: (err.print("[bold]you>[/] ", end="") or sys.stdin.readline()), "")),
              say=lambda text: err.print(text, markup=False, highlight=False),
              write=lambda text: (sys.stdout.write(text), sys.stdout.flush()))


feedback_app = typer.Typer(help="On-device preferences: export them for the next training round.",
                           no_args_is_help=True)
app.add_typer(feedback_app, name="feedback")


@feedback_app.command("export", epilog="Examples:\n\n  slm-align feedback export prefs.db --out round2.jsonl --scrub\n\n"
                                        "  slm-align train --stage reward --out runs/round2 --preferences round2.jsonl "
                                        "--preferences round2.unpaired.jsonl")
def feedback_export(
    db: Path = typer.Argument(..., help="Preference database written by the agent (chat, serve, Python API)."),
    out: Path = typer.Option(..., "--out", "-o", help="Pairs file (.jsonl); thumbs go to OUT's .unpaired.jsonl."),
    scrub: bool = typer.Option(False, "--scrub", help="Replace e-mails, phone numbers, cards, IPs, IBANs."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing output files."),
    as_json: bool = JsonFlag,
) -> None:
    """Write consented feedback as TRL rows: pairs {prompt, chosen, rejected} and unpaired {prompt, completion, label}."""
    from slm_align.agent.feedback_export import export_preferences

    result = export_preferences(db, out, scrub=scrub, overwrite=overwrite)
    emit(as_json, result, lambda: stdout.print(
        f"[bold]feedback[/] -> {result['out']} ({result['pairs']} pairs), {result['unpaired_out']} "
        f"({result['unpaired']} rated answers); {result['skipped_without_consent']} turns without consent skipped"
        + (f"; {result['scrubbed_replacements']} personal details scrubbed" if scrub else "")))


devices_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="markdown",
    help="Device profiles and fit / speed estimates: will this model run on my board, and how fast?",
    epilog="Examples:\n\n  slm-align devices list\n\n  slm-align devices show rpi5 --json\n\n"
           "  slm-align devices fit runs/demo/merged --device rpi5 --quant Q4_0 --context 2048")
app.add_typer(devices_app, name="devices")


@devices_app.command("list", epilog="Examples:\n\n  slm-align devices list\n\n  slm-align devices list --json\n\n"
                                    "  SLM_ALIGN_DEVICES=./my-devices slm-align devices list   # your own TOML files")
def devices_list(as_json: bool = JsonFlag) -> None:
    """List the device profiles: bundled, ~/.config/slm-align/devices/ and $SLM_ALIGN_DEVICES (user files win)."""
    from slm_align.devices import list_profiles, load_profile

    rows = [{"name": p.name, "device": p.display_name, "ram_gb": p.ram_gb, "bandwidth_gbs": p.bandwidth_gbs,
             "runtime": p.runtime, "quant": p.gguf_quant, "reference_points": len(p.reference)}
            for p in map(load_profile, list_profiles())]
    emit(as_json, {"devices": rows}, lambda: stdout.print(_rows_table("Device profiles", rows)))


@devices_app.command("show", epilog="Examples:\n\n  slm-align devices show rpi5\n\n"
                                    "  slm-align devices show x86-laptop --json")
def devices_show(name: str = typer.Argument(..., help="Profile name (see `slm-align devices list`)."),
                 as_json: bool = JsonFlag) -> None:
    """Show one device profile with its published reference measurements and their sources."""
    from slm_align.devices import load_profile

    profile = load_profile(name).model_dump()
    emit(as_json, profile, lambda: print_device(profile))


@devices_app.command("fit", epilog="Examples:\n\n  slm-align devices fit runs/demo/merged --device rpi5\n\n"
                                   "  slm-align devices fit model.gguf --device rpi-zero2w --context 1024\n\n"
                                   "  slm-align devices fit runs/demo/export/onnx --device android-mid --quant int8 "
                                   "--json")
def devices_fit(
    model: Path = typer.Argument(..., help="HF directory (safetensors), .gguf file or ONNX export directory."),
    device: str = typer.Option(..., "--device", help="Device profile name (see `slm-align devices list`)."),
    quant: Optional[str] = typer.Option(None, "--quant", help="Weight type, e.g. Q4_0, Q4_K_M, Q8_0, F16, int8 "
                                                              "(default: the device's preference, downgraded to fit)."),
    context: Optional[int] = typer.Option(None, "--context", help="Context length in tokens (default: 4096 or the "
                                                                  "model's own, if shorter)."),
    as_json: bool = JsonFlag,
) -> None:
    """Estimate memory, verdict (fits / tight / does not fit), largest context and decode speed on a device."""
    from slm_align.devices import estimate_fit, load_profile, model_facts

    profile = load_profile(device)
    report = estimate_fit(model_facts(model), profile, quant, context).to_dict()
    emit(as_json, report, lambda: print_fit(report))


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def _rows_table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title)
    for column in (rows[0] if rows else {}):
        table.add_column(column.replace("_", " "))
    for row in rows:
        table.add_row(*(str(value) for value in row.values()))
    return table


def print_device(profile: dict) -> None:
    table = Table(title=f"{profile['display_name']} ({profile['name']})", show_header=False)
    for key, value in profile.items():
        if key not in ("reference", "name", "display_name"):
            table.add_row(key.replace("_", " "), ", ".join(value) if isinstance(value, list) else str(value))
    stdout.print(table)
    rows = [{k: p[k] for k in ("model", "quant", "tokens_per_second", "context", "runtime", "source")}
            for p in profile["reference"]]
    stdout.print(_rows_table("Reference decode measurements", rows) if rows else "no reference measurements")


def print_fit(report: dict) -> None:
    memory, color = report["memory"], {"fits": "green", "tight": "yellow"}.get(report["verdict"], "red")
    table = Table(title=f"{report['model']} on {report['device']}", show_header=False)
    for label, value in (
            ("weights", f"{_size(memory['weights'])} ({report['quant']})"),
            ("KV cache", f"{_size(memory['kv_cache'])} at {report['context']} tokens"),
            ("runtime overhead", _size(memory["compute"] + memory["fixed"])),
            ("total / app budget", f"{_size(memory['total'])} / {_size(report['budget_bytes'])} "
                                   f"({report['share_of_budget']:.0%})"),
            ("verdict", f"[bold {color}]{report['verdict']}[/]"),
            ("largest context that fits", str(report["max_context"])),
            ("recommended quantization", report["recommended_quant"] or "none fits"),
            ("decode speed", f"~{report['tokens_per_second']:.1f} tokens/s (efficiency "
                             f"{report['efficiency']['value']:.2f}, {report['efficiency']['basis']})")):
        table.add_row(label, value)
    stdout.print(table)
    for note in report["notes"]:
        stdout.print(f"note: {note}")


@app.command(epilog="Examples:\n\n  slm-align bench runs/demo/export/model-Q8_0.gguf\n\n"
                    "  slm-align bench runs/demo/export/onnx-int8 --threads 4 --prompt-tokens 256 --repeats 5\n\n"
                    "  slm-align bench model-Q8_0.gguf --save-profile my-laptop     # then: devices fit ... "
                    "--device my-laptop\n\n"
                    "  slm-align bench model-Q8_0.gguf --device x86-laptop --json    # measured vs predicted")
def bench(
    artifact: Path = typer.Argument(..., help="Exported model: a .gguf file or an ONNX export directory."),
    threads: Optional[int] = typer.Option(None, min=1, help="Threads (default: this host's physical cores)."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="Prompt length fed at once."),
    decode_tokens: int = typer.Option(64, "--decode-tokens", min=1, help="Tokens generated after the first one."),
    repeats: int = typer.Option(3, min=1, help="Measurement repeats (speeds are medians)."),
    n_ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="Context window (default: the model's own)."),
    device: Optional[str] = typer.Option(None, "--device", help="Also show `devices fit`'s decode prediction for "
                                                               "this profile, and measured / predicted."),
    save_profile: Optional[str] = typer.Option(None, "--save-profile", help="Save this host as a user device "
                                               "profile NAME ($SLM_ALIGN_DEVICES or ~/.config/slm-align/devices/)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing profile of that name."),
    as_json: bool = JsonFlag,
) -> None:
    """Measure an exported model on this host: load time, time to first token, prompt and decode tokens/s, peak RAM."""
    from slm_align.devices.bench import run_bench

    summary = run_bench(artifact, threads, prompt_tokens, decode_tokens, repeats, n_ctx, device=device,
                        save_as=save_profile, overwrite=overwrite)
    emit(as_json, summary, lambda: print_bench(summary))


def print_bench(summary: dict) -> None:
    b, host = summary["bench"], summary["bench"]["host"]
    table = Table(title=f"{b['model']} ({b['kind']}, {b['runtime']})", show_header=False)
    for label, value in (
            ("host", f"{host['cpu']}, {host['cores']} cores, {host['ram_gb']:.1f} GiB, "
                     f"{' '.join(host['isa']) or 'no SIMD flags found'}"),
            ("threads / context", f"{b['threads']} / {b['n_ctx']} tokens"),
            ("load", f"{b['load_seconds'] * 1000:.0f} ms"),
            ("time to first token", f"{b['time_to_first_token_seconds'] * 1000:.0f} ms ({b['prompt_tokens']}-token "
                                    "prompt)"),
            ("prompt processing", f"{b['prompt_tokens_per_second']:.1f} tokens/s"),
            ("decode", f"{b['decode_tokens_per_second']:.1f} tokens/s (median of {b['repeats']}, "
                       f"{b['decode_tokens']} tokens each)"),
            ("peak memory (RSS)", f"{_size(b['peak_rss_bytes'])} ({_size(b['rss_before_load_bytes'])} before "
                                  f"loading, +{_size(b['model_rss_bytes'])} for the model)")):
        table.add_row(label, value)
    stdout.print(table)
    p = summary["prediction"]
    if p:
        stdout.print(f"prediction for {p['device']} ({p['quant']}, {p['context']} tokens): "
                     f"~{p['predicted_tokens_per_second']:.1f} tokens/s; measured / predicted = {p['ratio']:.2f}")
    if summary["saved_profile"]:
        saved = summary["saved_profile"]
        stdout.print(f"[bold]saved[/] device profile {saved['name']} -> {saved['path']} (bandwidth "
                     f"{saved['bandwidth_gbs']:.1f} GB/s); use it with --device {saved['name']}")


@app.command(epilog="Examples:\n\n  slm-align serve runs/demo/export/model-Q8_0.gguf --store prefs.db --consent   # open http://127.0.0.1:8080/\n\n"
                    "  SLM_ALIGN_API_KEY=s3cret slm-align serve model.gguf --host 0.0.0.0 --port 9000\n\n"
                    "  curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' "
                    "-d '{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'\n\n"
                    "Any OpenAI client works: base_url http://127.0.0.1:8080/v1, api_key the --api-key (or any text).")
def serve(
    artifact: Path = typer.Argument(..., help="Exported model: a .gguf file or an ONNX export directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; beyond loopback it needs --api-key."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on (0: any free one)."),
    store: Optional[Path] = typer.Option(None, "--store", help="Preference database (SQLite) for turns and feedback."),
    consent: bool = typer.Option(False, "--consent", help="Mark recorded turns as consented for training."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SLM_ALIGN_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 (env SLM_ALIGN_API_KEY)."),
    tools: bool = typer.Option(False, "--tools", help="Run the built-in tools (calculator, clock) on the server."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile for threads and context."),
    threads: Optional[int] = typer.Option(None, min=1, help="Threads (default: the device's, else all cores)."),
    n_ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="Context window in tokens."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow listening beyond loopback without an API key."),
    as_json: bool = JsonFlag,
) -> None:
    """Serve an exported model: an OpenAI-compatible API (/v1/chat/completions) and a chat page with feedback."""
    from slm_align.agent.server import serve as run_server

    run_server(artifact, host=host, port=port, api_key=api_key, insecure=insecure, store_path=store, consent=consent,
               tools=tools, device=device, threads=threads, n_ctx=n_ctx,
               announce=lambda info: emit(as_json, info, lambda: stdout.print(
                   f"[bold]serving[/] {info['model']} at {info['url']} (API at {info['url']}v1"
                   + (", key required" if info["api_key"] else "") + "); Ctrl-C stops")))


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2; bugs keep their traceback."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # our messages, not library advisories
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        code = typer.main.get_command(app).main(args=argv, prog_name="slm-align", standalone_mode=False)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        code = exc.exit_code
    except OSError as exc:  # a full disk or a permission: one line, not a traceback
        error = storage_error(exc)
        if error is None:
            raise
        sys.stderr.write(f"error: {error}\n")
        code = error.exit_code
    except TyperException as exc:  # usage errors of the parser (unknown option, bad value, missing argument)
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # the parser has already printed the help
            code = 0
        else:
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            sys.stderr.write(f"error: {' '.join(exc.format_message().split())}{hint}\n")
            code = EXIT_USER_ERROR
    except typer.Abort:
        sys.stderr.write("aborted\n")
        code = 130
    except typer.Exit as exc:
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)
