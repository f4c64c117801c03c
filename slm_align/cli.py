"""The ``slm-align`` command line. Thin: parse, call one function, print."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.exceptions import TyperException
from rich.console import Console
from rich.table import Table

from slm_align.errors import EXIT_USER_ERROR, NotYetAvailable, UserError

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
    sft_steps: int = typer.Option(150, help="SFT optimizer steps on the bundled model."),
    reward_steps: int = typer.Option(100, help="Reward-model optimizer steps."),
    rl_steps: int = typer.Option(20, help="PPO iterations."),
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
    preferences: Optional[str] = typer.Option(None, help="Preference file (TRL columns) for the reward model."),
    pair_mix: Optional[str] = typer.Option(None, help="Corruption weights, e.g. truncate=1,shuffle=1,mismatch=1,dropout=1."),
    no_synthetic_pairs: bool = typer.Option(False, "--no-synthetic-pairs", help="Train on --preferences only."),
    reward_steps: Optional[int] = typer.Option(None, help="Reward-model optimizer steps (default: one epoch)."),
    reward_lr: Optional[float] = typer.Option(None, help="Reward-model learning rate (default 1e-3)."),
    margin: Optional[float] = typer.Option(None, help="Bradley-Terry margin (default 0)."),
    center: Optional[float] = typer.Option(None, help="Reward-centering coefficient (default 0.01)."),
    steps: Optional[int] = typer.Option(None, help="RL iterations (default 40)."),
    rl_lr: Optional[float] = typer.Option(None, help="RL learning rate (default 1e-3)."),
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
                     **{"reward.preferences": preferences, "reward.pairs.mix": _pair_mix(pair_mix),
                        "reward.pairs.synthetic": off(no_synthetic_pairs), "reward.max_steps": reward_steps,
                        "reward.learning_rate": reward_lr, "reward.margin": margin, "reward.center_coefficient": center,
                        "rl.algo": algo, "rl.steps": steps, "rl.learning_rate": rl_lr,
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
    from slm_align.evaluate import evaluate as run_evaluation

    report = run_evaluation(recipe, out, sft_run=sft_from, reward_model=reward_model, rewards=reward)
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

    report = run_evaluation(_recipe(config), run, baselines=model, reward_model=reward_model, rewards=reward,
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


def _later(name: str, what: str, issue: str, examples: str) -> None:
    """Register a command whose capability a later issue builds: it says so in one line and exits 2."""

    def command(ctx: typer.Context, as_json: bool = JsonFlag) -> None:
        raise NotYetAvailable(f"`slm-align {name}` is not available yet: {what} arrives with {issue}")

    command.__doc__ = f"{what[0].upper()}{what[1:]} (not yet available: {issue})."
    app.command(name, epilog=f"Examples (once available):\n\n{examples}",
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


_later("export", "parity-checked GGUF and ONNX export", "the export issue (#6)",
       "  slm-align export runs/demo --target gguf --quant Q8_0")
_later("chat", "the terminal chat on an exported model", "the agent issue (#7)",
       "  slm-align chat runs/demo/export/model.gguf")
_later("feedback", "export of on-device preferences", "the agent issue (#7)",
       "  slm-align feedback export prefs.db --out prefs.jsonl")
_later("devices", "device profiles and fit estimates", "the devices issue (#8)",
       "  slm-align devices fit runs/demo --device rpi5")
_later("bench", "on-host speed and memory measurement", "the devices issue (#8)",
       "  slm-align bench runs/demo/export/model.gguf")


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2; bugs keep their traceback."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # our messages, not library advisories
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        code = typer.main.get_command(app).main(args=argv, prog_name="slm-align", standalone_mode=False)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        code = exc.exit_code
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
