"""Agent task success before and after RL, measured in the torch-free runtime
with real tool execution.

    python benchmarks/agent_tasks.py [--sft-steps 600] [--rl-steps 30] [--algo grpo] [--work DIR]

1. ``write_agent_tasks``: the bundled tool-use task (arithmetic and unit questions that need the calculator),
   SFT conversations, RL task rows and held-out tasks, split without leaks.
2. SFT on the conversations (the chat format and the Hermes tool-call syntax the runtime parses), exported to
   GGUF (F32: no quantization noise in the comparison).
3. RL (GRPO by default) on the task rows with the ``tool_task`` reward (right tool, valid arguments, the tool's
   result equals the answer), the gate's figures and advice printed, exported the same way.
4. Both artifacts answer every held-out task in ``Agent`` (greedy, the built-in tools executed for real); the
   table shows task success, valid calls, rounds, tokens and failure kinds, and SFT -> RL with its
   paired bootstrap interval. A gain whose interval includes zero is not a gain.

The model is the bundled 2.5M Llama unless ``--model`` names another source (a real checkpoint
takes hours on two CPU cores).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from slm_align import ExportRequest, load_recipe, run_export, run_rl, run_sft
from slm_align.agent.task_eval import evaluate_artifacts
from slm_align.data.agent_tasks import write_agent_tasks

COLUMNS = ("success_rate", "call_rate", "valid_call_rate", "rounds_per_task", "tokens_per_task")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Model source (default: the bundled model).")
    parser.add_argument("--train", type=int, default=400, help="Training tasks.")
    parser.add_argument("--heldout", type=int, default=100, help="Held-out tasks for the runtime evaluation.")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--sft-lr", type=float, default=None, help="SFT learning rate (default: the recipe's).")
    parser.add_argument("--lora-r", type=int, default=None, help="SFT LoRA rank (default: the recipe's).")
    parser.add_argument("--lora-targets", default=None, help="SFT LoRA modules, comma-separated "
                        "(default: the architecture's).")
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--algo", default="grpo", choices=("ppo", "grpo", "auto"))
    parser.add_argument("--work", type=Path, default=None, help="Working directory (default: a new temporary one).")
    return parser.parse_args()


def export(run: Path, out: Path) -> Path:
    """The run's latest policy (RL when present, else SFT) merged and written as an F32
    GGUF (kept on a rerun)."""
    from slm_align.export.stage import artifact_name

    final = out / artifact_name("gguf", "F32")
    if final.is_file():
        return final
    return run_export(ExportRequest(str(run), "gguf", "F32", out=out)).stage_dir


def train(args: argparse.Namespace, files: dict, run: Path) -> dict:
    """SFT, its export, RL with the tool_task reward, its export; the seconds of each
    and the gate's verdict."""
    targets = None
    if args.lora_targets:
        targets = args.lora_targets.split(",")
    recipe = load_recipe(overrides={"model.source": args.model, "data.path": str(files["sft"]),
                                    "data.tasks": str(files["train"]), "sft.max_steps": args.sft_steps,
                                    "sft.batch_size": 16, "rl.algo": args.algo, "rl.steps": args.rl_steps,
                                    "rl.max_new_tokens": 48, "rl.report_prompts": 0, "sft.learning_rate": args.sft_lr,
                                    "sft.lora.r": args.lora_r, "sft.lora.target_modules": targets})
    seconds = {}
    started = time.time()
    run_sft(recipe, run, resume=True)  # a rerun on the same --work continues or reuses it
    seconds["sft"] = time.time() - started
    sft_artifact = export(run, run.parent / "export-sft")
    started = time.time()
    rl = run_rl(recipe, run, rewards=["tool_task"], force=True, resume=True)
    seconds["rl"] = time.time() - started
    rl_artifact = export(run, run.parent / "export-rl")
    headroom = json.loads((run / "headroom.json").read_text(encoding="utf-8"))
    return {"sft": sft_artifact, "rl": rl_artifact, "seconds": seconds, "gate": headroom, "rl_metrics": rl.metrics}


def print_report(report: dict, trained: dict) -> None:
    gate = trained["gate"]
    print(f"gate: {gate['verdict']}; " + "; ".join(f"{f['name']} {f['value']:.3g}" for f in gate["figures"]))
    if "recommendation" in gate["info"]:
        print(f"gate advice: {gate['info']['recommendation']['why']}")
    m = trained["rl_metrics"]
    print(f"RL ({m['algo']}, {m['steps']} iterations): held-out tool_task reward "
          f"{m['heldout_reward_sft']:.3f} -> {m['heldout_reward_rl']:.3f}; SFT "
          f"{trained['seconds']['sft']:.0f} s, RL {trained['seconds']['rl']:.0f} s")
    print(f"\n{'artifact':<8} " + " ".join(f"{name:>16}" for name in COLUMNS) + "  failures")
    for name, row in zip(("SFT", "RL"), report["artifacts"]):
        cells = []
        for column in COLUMNS:
            value = row[column]
            cells.append(f"{value:>16.3f}" if value is not None else f"{'-':>16}")
        print(f"{name:<8} " + " ".join(cells) + f"  {row['failures']}")
    comparison = report["comparisons"][0]
    low, high = comparison["ci95"]
    print(f"\nRL - SFT task success on {report['n_tasks']} held-out tasks: "
          f"{comparison['success_delta']:+.3f} (95% CI {low:+.3f} .. {high:+.3f}): "
          f"{comparison['verdict']}")


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="agent-tasks-"))
    files = write_agent_tasks(work / "tasks", n_train=args.train, n_heldout=args.heldout, seed=0, overwrite=True)
    trained = train(args, files, work / "run")
    report = evaluate_artifacts(files["heldout"], [trained["sft"], trained["rl"]])
    (work / "agent_eval.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print_report(report, trained)
    print(f"\nartifacts and the full report in {work}")


if __name__ == "__main__":
    main()
