"""The quickstart's stages: function calling with scarce demonstrations and cheap checks.

The generated function-calling family (``tasks make --kind functions``) gives training rows and
held-out rows whose functions training never offers; SFT sees a few demonstrations only (the first
:attr:`AgentSizes.demonstrations` training chats, every one a right call or a right refusal: no
handicap), GRPO then learns from the checker alone (``function_call_match``, BFCL's rules) on many
training prompts, no more demonstrations. The bundled model as shipped, the SFT and the RL policy
are exported to GGUF and judged in the torch-free runtime on the held-out functions, with the paired
interval RL - SFT.

Rows offer one function or a few (BFCL's simple, parallel and irrelevance categories): the bundled
model's context is 512 tokens, and a row offering four functions with their descriptions does not
fit in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from slm_align.atomic import write_text_atomic
from slm_align.config import Recipe, load_recipe
from slm_align.data.function_tasks import CATEGORIES, FILES, write_function_tasks
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.agent.task_eval import TaskResult, compare, evaluate_artifacts
from slm_align.pipeline import export_once, gate, run_rl, run_sft
from slm_align.rl.algorithms import rl_algorithm

Say = Callable[[str], None]
REWARD = "function_call_match"
"""The check GRPO learns from: 1 when the reply's calls match the row's ground truth by BFCL's
rules."""
QUANT = "Q8_0"
"""The exports: llama.cpp's 8-bit type, what the runtime runs."""
MIX = {"simple": 0.5, "parallel": 0.25, "irrelevance": 0.25}
"""The categories of the quickstart's rows (those that fit the bundled model's 512-token
context)."""
DEMONSTRATIONS = "demonstrations.jsonl"
"""The few SFT chats, beside the task files."""
SEED = 0
"""The task generator's seed."""


@dataclass(frozen=True)
class AgentSizes:
    """How much the quickstart trains and judges."""

    train_tasks: int = 400
    """Training rows: GRPO's checked prompts."""
    heldout_tasks: int = 100
    """Held-out rows (functions training never offers) judged in the runtime."""
    demonstrations: int = 64
    """Training rows whose chats SFT sees: the scarce demonstrations."""
    sft_steps: int = 60
    """SFT optimizer steps on the demonstrations."""
    rl_steps: int = 10
    """GRPO iterations on the training prompts."""
    max_new_tokens: int = 64
    """Tokens a reply may take, in RL and in the judgement."""


def agent_recipe(run: Path, sizes: AgentSizes, device: str,
                 overrides: Optional[dict] = None) -> Recipe:
    """SFT on the demonstrations, then GRPO on one-reply episodes of the training rows (the calls
    are the answer, nothing runs: ``max_tool_rounds`` 0, as ``evaluate-agent`` judges function
    rows); ``overrides`` (recipe keys) on top, as the function-calling benchmark sets its model and
    budget."""
    tasks = run / "tasks"
    return load_recipe(overrides={
        "data.path": str(tasks / DEMONSTRATIONS), "data.tasks": str(tasks / "train.jsonl"),
        "data.max_length": 512, "sft.max_steps": sizes.sft_steps, "sft.batch_size": 8,
        "sft.save_steps": 50, "rl.algo": "grpo", "rl.episodes": "on", "rl.steps": sizes.rl_steps,
        "rl.prompts_per_step": 4, "rl.group_size": 8, "rl.minibatch_size": 16,
        "rl.max_new_tokens": sizes.max_new_tokens, "rl.temperature": 0.8, "rl.learning_rate": 3e-4,
        "rl.max_tool_rounds": 0, "rl.eval_prompts": 16, "rl.report_prompts": 0,
        "rl.watchdog.probe_prompts": 8, "compute.device": device, **(overrides or {})})


def tasks_step(run: Path, sizes: AgentSizes, say: Say, mix: Optional[dict] = None,
               twins: bool = False) -> dict:
    """The function-calling rows (``mix``: the categories' shares, default :data:`MIX`; ``twins``:
    each training irrelevance row with a twin that calls, as ``tasks make --twins``) and the few
    demonstrations (kept when an earlier run wrote them)."""
    tasks = run / "tasks"
    mix = mix or MIX
    named = ", ".join(category for category in CATEGORIES if mix.get(category))
    say(f"[bold]1/4 function tasks[/] {sizes.train_tasks} training and {sizes.heldout_tasks} "
        f"held-out rows ({named}); held-out rows offer functions training "
        f"never sees; SFT sees the chats of the first {sizes.demonstrations} training rows only")
    if not all((tasks / f"{name}.jsonl").is_file() for name in FILES):
        write_function_tasks(tasks, sizes.train_tasks, sizes.heldout_tasks, seed=SEED,
                             overwrite=True, mix=mix, twins=twins)
    if not (tasks / DEMONSTRATIONS).is_file():
        chats = (tasks / "sft.jsonl").read_text(encoding="utf-8").splitlines()
        write_text_atomic(tasks / DEMONSTRATIONS, "\n".join(chats[:sizes.demonstrations]) + "\n")
    files = {name: str(tasks / f"{name}.jsonl") for name in FILES}
    return dict(files, demonstrations=str(tasks / DEMONSTRATIONS))


def sft_step(recipe: Recipe, run: Path, sizes: AgentSizes, say: Say) -> dict:
    """SFT on the demonstrations, exported as the baseline."""
    say(f"[bold]2/4 SFT[/] the bundled model on {sizes.demonstrations} demonstrations "
        f"({recipe.sft.max_steps} steps of {recipe.sft.batch_size})")
    stage = run_sft(recipe, run, resume=True)
    m = stage.metrics
    artifact = export_policy(run, run / "export-sft")
    say(f"    {'reused' if stage.skipped else 'trained'} {stage.stage_dir}: train loss "
        f"{m['train_loss']:.3f}, eval loss {m['eval_loss']:.3f}; exported {artifact}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": m,
            "artifact": str(artifact)}


def rl_step(recipe: Recipe, run: Path, say: Say) -> dict:
    """The gate on the check, then GRPO from the SFT policy (run whatever the gate says, the verdict
    recorded: the quickstart shows what RL does here), exported."""
    rl = recipe.rl
    samples = rl_algorithm(rl.algo).iteration_size(rl).samples
    say(f"[bold]3/4 RL[/] gate, then GRPO on the training prompts, no more demonstrations "
        f"({rl.steps} iterations of {samples} replies, reward {REWARD})")
    report = gate(recipe, run, adapter=None, reward_model=None, rewards=(REWARD,), force=True)
    say(f"    gate: {report['verdict']}" + "".join(f"; {reason}" for reason in report["reasons"]))
    stage = run_rl(recipe, run, rewards=[REWARD], force=True, resume=True)
    m = stage.metrics
    artifact = export_policy(run, run / "export-rl")
    say(f"    {'reused' if stage.skipped else 'trained'} {stage.stage_dir}: check passed on unseen "
        f"prompts of the training functions SFT {m['heldout_reward_sft']:.3f} -> RL "
        f"{m['heldout_reward_rl']:.3f}; exported {artifact}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "gate": report["verdict"],
            "gate_reasons": report["reasons"], "metrics": m, "artifact": str(artifact)}


def judge_step(run: Path, artifacts: dict[str, Path], sizes: AgentSizes, say: Say) -> dict:
    """``evaluate-agent`` on the base, SFT and RL exports (``artifacts`` in that order) over the
    held-out rows: success with its interval and per category, and the paired differences SFT - base
    and RL - SFT; the whole report in ``run/agent_report.json``."""
    say("[bold]4/4 evaluate-agent[/] base, SFT and RL exports in the torch-free runtime, greedy, "
        f"on {sizes.heldout_tasks} held-out rows (BFCL's rules)")
    report = evaluate_artifacts(run / "tasks" / "heldout.jsonl", list(artifacts.values()),
                                max_tokens=sizes.max_new_tokens, max_tool_rounds=0)
    for name, row in zip(artifacts, report["artifacts"]):
        low, high = row["success_ci95"]
        categories = ", ".join(f"{group} {figures['accuracy']:.2f}"
                               for group, figures in row["by_category"].items())
        say(f"    {name}: success {row['success_rate']:.3f} [95% CI {low:.3f}, {high:.3f}] "
            f"({categories}); call rate {row['call_rate']:.2f}")
    results = {name: [TaskResult(**r) for r in row["results"]]
               for name, row in zip(artifacts, report["artifacts"])}
    differences = {}
    for candidate, baseline in (("SFT", "base"), ("RL", "SFT")):
        found = compare(results[baseline], results[candidate])
        differences[f"{candidate} - {baseline}"] = found
        low, high = found["ci95"]
        say(f"    {candidate} - {baseline}: {found['success_delta']:+.3f} [95% CI {low:+.3f}, "
            f"{high:+.3f}] (paired bootstrap over rows): {verdict_words(found)}")
    write_text_atomic(run / "agent_report.json", json.dumps(report, indent=1))
    return {"artifacts": {name: _figures(row) for name, row in zip(artifacts, report["artifacts"])},
            "differences": differences}


def verdict_words(found: dict) -> str:
    """A paired difference in plain words: ``gain`` only when its interval lies above zero."""
    low, high = found["ci95"]
    if low > 0:
        return "gain"
    if high < 0:
        return "loss"
    return "no gain (the interval includes zero)"


def _figures(row: dict) -> dict:
    """An artifact's summary without its per-row results."""
    return {key: value for key, value in row.items() if key != "results"}


def base_step(run: Path) -> Path:
    """The bundled model as it ships, exported like the policies: the zero-shot baseline."""
    return export_policy(DEFAULT_MODEL_DIR, run / "export-base")


def export_policy(source: Path, out: Path) -> Path:
    """``source`` (a run: its latest policy, merged) as a parity-checked Q8_0 GGUF in ``out`` (kept
    when there)."""
    return Path(export_once(source, "gguf", QUANT, out)["dir"])
