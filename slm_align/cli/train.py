"""Training-stage commands: sft, check-headroom, quickstart, train and evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from slm_align.cli.options import (
    ALLOW_PICKLE,
    DEVICE,
    OUT_NAMES,
    THREADS,
    ConfigOpt,
    Flag,
    JsonFlag,
    ThreadsOpt,
    recipe_flags,
    recipe_from,
    recipe_option,
    use_threads,
)
from slm_align.cli.render import (
    emit,
    print_evaluation,
    print_headroom,
    print_preference,
    print_reward,
    print_rl,
    print_sft,
    stdout,
)
from slm_align.data.corpus import require_data
from slm_align.errors import UserError
from slm_align.progress import quiet

commands = typer.Typer()


def comma_list(text: str) -> list[str]:
    """"q_proj,v_proj" -> ["q_proj", "v_proj"]."""
    return text.split(",")


def pair_mix(text: str) -> dict[str, float]:
    """"truncate=1,shuffle=2" -> {"truncate": 1.0, "shuffle": 2.0}; a name
    without a weight weighs 1."""
    mix = {}
    for item in text.split(","):
        name, _, weight = item.partition("=")
        try:
            mix[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise UserError(f"--pair-mix {text}: weight {weight!r} is not a number "
                            "(e.g. truncate=1,shuffle=2)") from None
    return mix


def on_off(text: str) -> bool:
    """"on" -> True, "off" -> False (a switch that is on by default and can
    be turned off by name)."""
    if text not in ("on", "off"):
        raise UserError(f"--watchdog {text}: choose on or off")
    return text == "on"


# The recipe flags: (flag, dotted recipe key). Help and shown default come from the
# recipe field; the commands that take a table receive its flags as load_recipe overrides
# (see options.recipe_flags).
SOURCE = (
    Flag("--model", "model.source", short="-m"),
    Flag("--data", "data.path", short="-d"),
    Flag("--text-field", "data.text_field"),
    Flag("--seed", "seed"),
)
TASKS = (
    Flag("--tasks", "data.tasks"),
)
SAFETY = (
    Flag("--trust-remote-code", "model.trust_remote_code", sets=True),
    ALLOW_PICKLE,
)
COMPUTE = (
    DEVICE,
    THREADS,
    Flag("--precision", "compute.precision"),
    Flag("--gradient-checkpointing", "compute.gradient_checkpointing", sets=True),
    Flag("--load-in-4bit", "compute.load_in_4bit", sets=True),
    Flag("--deepspeed", "compute.deepspeed"),
)
SFT = (
    Flag("--epochs", "sft.epochs", aliases=("--num-train-epochs",)),
    Flag("--max-steps", "sft.max_steps"),
    Flag("--lr", "sft.learning_rate", aliases=("--learning-rate",)),
    Flag("--batch-size", "sft.batch_size", aliases=("--per-device-train-batch-size",)),
    Flag("--grad-accum", "sft.grad_accum", aliases=("--gradient-accumulation-steps",)),
    Flag("--warmup-ratio", "sft.warmup_ratio"),
    Flag("--neftune-alpha", "sft.neftune_alpha", aliases=("--neftune-noise-alpha",)),
    Flag("--lora-r", "sft.lora.r"),
    Flag("--lora-alpha", "sft.lora.alpha"),
    Flag("--lora-dropout", "sft.lora.dropout"),
    Flag("--lora-targets", "sft.lora.target_modules", parse=comma_list, note="Comma-separated.",
         aliases=("--lora-target-modules",)),
    Flag("--max-length", "data.max_length"),
    Flag("--save-steps", "sft.save_steps"),
)
HEADROOM = (
    Flag("--max-ppl", "headroom.max_ppl"),
    Flag("--min-reward-acc", "headroom.min_reward_accuracy"),
    Flag("--min-reward-std", "headroom.min_reward_std"),
    Flag("--gate-samples", "headroom.samples_per_prompt"),
    Flag("--max-all-equal", "headroom.max_all_equal_share"),
)
REWARD = (
    Flag("--preferences", "reward.preferences", repeat=True, note="Repeatable."),
    Flag("--pair-mix", "reward.pairs.mix", parse=pair_mix, note="As NAME=WEIGHT,..."),
    Flag("--no-synthetic-pairs", "reward.pairs.synthetic", sets=False, help="Train on --preferences only."),
    Flag("--reward-steps", "reward.max_steps"),
    Flag("--reward-lr", "reward.learning_rate"),
    Flag("--margin", "reward.margin"),
    Flag("--center", "reward.center_coefficient"),
)
MAX_NEW_TOKENS = Flag("--max-new-tokens", "rl.max_new_tokens", aliases=("--max-completion-length",))
ENVIRONMENT_MODULE = Flag("--environment-module", "rl.environment_modules", repeat=True, note="Repeatable.")
RL = (
    Flag("--algo", "rl.algo"),
    Flag("--no-sft", "rl.from_sft", sets=False, help="Start RL from the model as given (already "
         "fluent): no SFT stage; the gate measures the model itself. Needs "
         "--reward or --reward-model."),
    Flag("--steps", "rl.steps"),
    Flag("--rl-lr", "rl.learning_rate"),
    Flag("--rl-warmup-steps", "rl.warmup_steps"),
    Flag("--prompts-per-step", "rl.prompts_per_step"),
    Flag("--group-size", "rl.group_size", aliases=("--num-generations",)),
    Flag("--micro-batch-size", "rl.micro_batch_size"),
    MAX_NEW_TOKENS,
    Flag("--kl-coef", "rl.ppo.kl_coef"),
    Flag("--kl-mode", "rl.ppo.kl_mode"),
    Flag("--adaptive-kl", "rl.ppo.adaptive_kl", sets=True),
    Flag("--beta", "rl.grpo.beta"),
    Flag("--loss-type", "rl.grpo.loss_type"),
    Flag("--scale-rewards", "rl.grpo.scale_rewards"),
    Flag("--resample-zero-std", "rl.grpo.resample_zero_std", sets=True),
    Flag("--refill-flat", "rl.grpo.refill_flat"),
    Flag("--mask-truncated", "rl.mask_truncated", sets=True, aliases=("--mask-truncated-completions",)),
    Flag("--length-penalty", "rl.length_penalty"),
    Flag("--no-reinit-lora", "rl.envelope.reinit_lora", sets=False,
         help="ENVELOPE OFF: keep the SFT adapter as loaded."),
    Flag("--no-ratio-guard", "rl.envelope.ratio_guard", sets=0.0, help="ENVELOPE OFF: never skip on the ratio."),
    Flag("--no-rollback", "rl.envelope.rollback", sets=False, help="ENVELOPE OFF: no snapshot/rollback on NaN."),
    Flag("--sigma-clip", "rl.envelope.sigma_clip"),
    Flag("--grad-clip", "rl.envelope.grad_clip"),
    Flag("--watchdog", "rl.watchdog.enabled", parse=on_off, note="on or off (default on); off is recorded."),
    Flag("--watchdog-every", "rl.watchdog.eval_every"),
    Flag("--report-prompts", "rl.report_prompts"),
    Flag("--episodes", "rl.episodes"),
    Flag("--max-tool-rounds", "rl.max_tool_rounds"),
    Flag("--environment", "rl.environment"),
    ENVIRONMENT_MODULE,
)
TRACKING = (
    Flag("--report-to", "tracking.report_to"),
)
SAMPLING = (
    MAX_NEW_TOKENS,
    Flag("--temperature", "rl.temperature"),
)
PREFERENCE = (
    Flag("--pref-steps", "preference.steps"),
    Flag("--pref-lr", "preference.learning_rate"),
    Flag("--pref-beta", "preference.beta"),
    Flag("--pref-batch-size", "preference.batch_size"),
    Flag("--desirable-weight", "preference.desirable_weight"),
    Flag("--undesirable-weight", "preference.undesirable_weight"),
    Flag("--any-model", "preference.any_model", sets=True),
)

RUN_DIR_HELP = "Run directory."


@commands.command(epilog="Examples:\n\n  slm-align sft --data stories.txt --out runs/demo\n\n  "
                         "slm-align sft --model ./SmolLM2-135M --data chat.jsonl --lora-r 32 "
                         "--epochs 2 --out runs/chat\n\n  slm-align sft --data demo --out "
                         "runs/demo   # the generated demo stories\n\n  slm-align sft --data "
                         "stories.txt --out runs/demo --resume   # continue an interrupted run")
@recipe_flags(SOURCE, SFT, SAFETY, COMPUTE, TRACKING)
def sft(
    out: Path = typer.Option(Path("runs/default"), *OUT_NAMES, help="Run directory; SFT writes OUT/sft/."),
    config: Optional[Path] = ConfigOpt,
    settings: Optional[dict[str, Any]] = None,
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted SFT run in OUT."),
    as_json: bool = JsonFlag,
) -> None:
    """Supervised fine-tuning with LoRA and NEFTune; writes the adapter,
    tokenizer and a manifest."""
    from slm_align.sft.stage import run_sft

    recipe = recipe_from(config, settings)
    require_data(recipe.data)
    result = run_sft(recipe, out, resume=resume)
    if result.primary:  # rank 0 of a data-parallel run reports
        summary = result.summary()
        emit(as_json, summary, lambda: print_sft(summary))


@commands.command("check-headroom",
                  epilog="Exit code 0 on PASS, 1 on FAIL, 2 on bad input. Writes nothing: the report is "
                         "printed (--json: on stdout); the run's headroom.json stays train's record.\n\n"
                         "Examples:\n\n  "
                         "slm-align check-headroom --run runs/demo   # what train measured: its tasks and reward\n\n  "
                         "slm-align check-headroom --run runs/demo --stage rl   # the RL policy, judged the same "
                         "way\n\n  slm-align check-headroom "
                         "--model ./base --adapter runs/demo/sft/adapter --data eval.jsonl\n\n  "
                         "slm-align check-headroom --run runs/demo --max-ppl 15 --json\n\n  "
                         "slm-align check-headroom --run runs/demo --reward "
                         "mypkg.rewards:politeness@0.5")
@recipe_flags(SOURCE, TASKS, HEADROOM, SAFETY, [DEVICE, ENVIRONMENT_MODULE, THREADS])
def check_headroom(
    run: Optional[Path] = typer.Option(None, "--run", "-r", help="Run directory with a finished SFT stage: "
                                       "measured as its train's gate measured it (tasks, reward, episode and "
                                       "gate settings recorded in its headroom.json); flags replace them."),
    stage: str = typer.Option("sft", "--stage", help="The policy judged: sft (the prior train gates), rl, dpo "
                              "or kto (the run's finished stage, on the merged SFT prior)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="SFT adapter directory (with --model)."),
    config: Optional[Path] = ConfigOpt,
    settings: Optional[dict[str, Any]] = None,
    reward_model: Optional[Path] = typer.Option(None, help="Reward model dir (default: the run's recorded "
                                                           "one, else its reward/model)."),
    reward: list[str] = typer.Option([], "--reward", help="Reward function module:function[@weight] or a built-in "
                                                          "(length_window, exact_answer, "
                                                          "json_tool_call); repeatable; with --run it replaces "
                                                          "the recorded reward, as train takes it."),
    as_json: bool = JsonFlag,
) -> None:
    """Measure whether RL has headroom: SFT perplexity, reward accuracy and reward
    spread against thresholds."""
    from slm_align.headroom.stage import aligned_adapter, as_recorded
    from slm_align.headroom.stage import check_headroom as measure_headroom

    if run is not None and settings["model.source"] is not None:
        raise UserError("pass either --run or --model, not both")
    aligned_adapter(run, stage)  # a stage the run has not finished: refused before anything loads
    request = None
    if run is not None:
        settings, reward, reward_model, request = as_recorded(run, settings, reward, reward_model)
    recipe = recipe_from(config, settings)
    require_data(recipe.data, from_run=run is not None and recipe.rl.from_sft, tasks_stand_in=True)
    report = measure_headroom(recipe, run=run, adapter=adapter, reward_model=reward_model, rewards=reward,
                              stage=stage).to_dict()
    if request is not None:
        report["info"]["measured_as"] = f"the gate of train in {run / 'headroom.json'}"
    emit(as_json, report, lambda: print_headroom(report))
    raise typer.Exit(0 if report["passed"] else 1)


@commands.command(epilog="Examples:\n\n  slm-align quickstart\n\n  slm-align "
                         "quickstart --out runs/qs --json")
def quickstart(
    out: Path = typer.Option(Path("runs/quickstart"), *OUT_NAMES, help=RUN_DIR_HELP),
    sft_steps: Optional[int] = typer.Option(None, min=1, help="SFT optimizer steps on the few "
                                            "demonstrations (default 60)."),
    rl_steps: Optional[int] = typer.Option(None, min=1, help="GRPO iterations on the checked prompts "
                                           "(default 10)."),
    device: Optional[str] = recipe_option("compute.device", "--device"),
    threads: Optional[int] = ThreadsOpt,
    as_json: bool = JsonFlag,
) -> None:
    """Walk the loop on the bundled model: function calling from a few demonstrations (SFT), then from checks
    alone (GRPO on many prompts), the base, SFT and RL exports judged by evaluate-agent on held-out functions
    with the paired interval RL - SFT; each stage's figures and seconds."""
    from slm_align.quickstart import run_quickstart

    use_threads(threads)
    say = None if as_json else stdout.print
    result = run_quickstart(out, sft_steps=sft_steps, rl_steps=rl_steps, say=say, device=device or "auto")
    emit(as_json, result, lambda: None)
    raise typer.Exit(0)


@commands.command(epilog="Examples:\n\n  slm-align train --algo grpo --data stories.txt --out "
                         "runs/demo   # SFT, reward model, gate, GRPO\n\n  slm-align train --data "
                         "demo --out runs/demo          # the same on the generated demo "
                         "stories\n\n  slm-align train --algo ppo --out runs/demo --steps 100 "
                         "--kl-coef 0.1\n\n  slm-align train --algo grpo --sft runs/base "
                         "--reward-model rm/ --reward my_rewards:fn@0.5 --out runs/g\n\n  "
                         "slm-align train --stage reward --out runs/demo --preferences prefs.jsonl "
                         "--pair-mix shuffle=2,truncate=1\n\n  slm-align train --data stories.txt "
                         "--out runs/demo --resume   # continue a killed run\n\n  slm-align train "
                         "--out runs/demo --force               # train although the gate says "
                         "FAIL (recorded)\n\n  slm-align train --algo auto --data chat.jsonl "
                         "--tasks tasks.jsonl --reward exact_answer --out runs/t  # the gate picks "
                         "PPO or GRPO\n\n  slm-align train --algo dpo --out runs/demo "
                         "--preferences prefs.jsonl --preferences prefs.unpaired.jsonl   # DPO on "
                         "device feedback\n\n  slm-align train --algo kto --out runs/demo "
                         "--preferences prefs.unpaired.jsonl --desirable-weight 1.5\n\n  slm-align train --algo grpo "
                         "--data agent_sft.jsonl --tasks agent_tasks.jsonl --reward task_success "
                         "--reward call_format@0.2 --max-tool-rounds 2 --out runs/agent   # multi-turn "
                         "agent episodes")
@recipe_flags(SOURCE, TASKS, HEADROOM, REWARD, RL, PREFERENCE, SAFETY, COMPUTE, TRACKING)
def train(
    out: Path = typer.Option(Path("runs/default"), *OUT_NAMES, help=RUN_DIR_HELP),
    stage: str = typer.Option("rl", help="sft, reward, or rl (runs the stages it "
                                         "needs, the gate, then RL)."),
    config: Optional[Path] = ConfigOpt,
    settings: Optional[dict[str, Any]] = None,
    sft_from: Optional[Path] = typer.Option(None, "--sft", help="Take the finished SFT "
                                                                "stage of this run instead."),
    reward_model: Optional[Path] = typer.Option(None, help="Use this reward model dir "
                                                           "instead of training one."),
    reward: list[str] = typer.Option([], "--reward", help="Reward function "
                                     "module:function[@weight] or a built-in; repeatable; added "
                                     "to the reward model."),
    force: bool = typer.Option(False, "--force", help="Train even when the headroom "
                                                      "gate says FAIL (recorded)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted stage in OUT."),
    as_json: bool = JsonFlag,
) -> None:
    """Train: SFT, the Bradley-Terry reward model, the headroom gate, then PPO or GRPO in the safety
    envelope; or DPO/KTO (--algo dpo|kto) on --preferences files from the SFT prior."""
    from slm_align.pipeline import RLRequest, check_stage, data_from_run, trains_on_preferences
    from slm_align.pipeline import train as run_pipeline

    check_stage(stage)
    recipe = recipe_from(config, settings)
    require_data(recipe.data, from_run=data_from_run(recipe, stage, out, sft_from),
                 tasks_stand_in=stage == "rl" and not recipe.rl.from_sft)
    request = RLRequest(sft_from, reward_model, tuple(reward), force, resume)
    say = quiet if as_json else stdout.print
    trained = run_pipeline(recipe, out, stage, request, say)
    result = trained.result
    if not result.primary:  # the other ranks of a data-parallel run: rank 0 reports
        return
    summary = result.summary()
    printer = SUMMARY_PRINTERS[stage]
    if stage == "rl" and trains_on_preferences(recipe.rl.algo):
        printer = print_preference
    if trained.evaluation is None:
        emit(as_json, summary, lambda: printer(summary))
        return
    report = trained.evaluation
    summary = dict(summary, evaluation=report["comparisons"])
    report_path = out / "eval" / "report.md"
    emit(as_json, summary, lambda: (print_rl(summary), print_evaluation(report, report_path)))


SUMMARY_PRINTERS = {"sft": print_sft, "reward": print_reward, "rl": print_rl}


@commands.command(epilog="Examples:\n\n  slm-align evaluate --run runs/demo\n\n  slm-align "
                         "evaluate --run runs/demo --baseline ./SmolLM2-135M-Instruct --prompts "
                         "100\n\n  slm-align evaluate --run runs/demo --reward length_window@0.5 "
                         "--json\n\n  slm-align evaluate --run runs/demo --set rl.temperature=0.7 "
                         "--set headroom.max_documents=50")
@recipe_flags(SAMPLING, TASKS, [DEVICE, THREADS, ALLOW_PICKLE])
def evaluate(
    run: Path = typer.Option(..., "--run", "-r", help="Run directory (SFT required; RL and "
                                                      "reward used if present)."),
    baseline: list[str] = typer.Option([], "--baseline", help="Add a baseline policy from any "
                                                              "model source; repeatable (was --model)."),
    reward_model: Optional[Path] = typer.Option(None, help="Shared reward model (default: the "
                                                "run's reward/model)."),
    reward: list[str] = typer.Option([], "--reward", help="Reward function module:function[@weight]; repeatable."),
    prompts: int = typer.Option(200, min=2, help="Held-out prompts to sample."),
    config: Optional[Path] = ConfigOpt,
    settings: Optional[dict[str, Any]] = None,
    as_json: bool = JsonFlag,
) -> None:
    """Compare the SFT prior, the aligned policy and any baselines on held-out
    prompts; write eval/report.md."""
    from slm_align.evaluate.stage import evaluate as run_evaluation

    recipe = recipe_from(config, settings)  # sampling settings (--max-new-tokens, --temperature) are the recipe's
    report = run_evaluation(recipe, run, baselines=baseline, reward_model=reward_model, rewards=reward,
                            prompts=prompts)
    emit(as_json, report, lambda: print_evaluation(report, Path(run) / "eval" / "report.md"))
