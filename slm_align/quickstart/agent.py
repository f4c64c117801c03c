"""The quickstart's agent stages: the bundled tool tasks, SFT on their chats (half of them a teacher answering
from memory, a habit the student cannot carry out), the gate and GRPO on multi-turn episodes scored by task
success; the bundled model as shipped, the SFT and the RL policy exported and judged in the
torch-free runtime with the calculator executed for real; then one tool turn in the agent and a thumbs-up into the
store."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slm_align.config import Recipe, load_recipe
from slm_align.data.agent_tasks import FILES, write_agent_tasks
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.agent.task_eval import TaskResult, compare, evaluate_artifacts
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.pipeline import export_once, gate, run_rl, run_sft
from slm_align.rl.schedule import iteration_size

Say = Callable[[str], None]
REWARD = "task_success"
"""The episode's reward: 1 when the final answer is the task's answer."""
QUANT = "Q8_0"
"""The agent's exports: llama.cpp's 8-bit type, what the runtime runs."""
MEMORY_SHARE = 0.5
"""Share of the training tasks whose SFT chat answers from memory, without the calculator: a teacher's habit that
SFT copies into a student that cannot multiply, and that RL on task success corrects."""
QUESTION = "What is 47 times 38?"
"""The tool turn shown at the end (not a held-out question; any calculator question would do)."""


@dataclass(frozen=True)
class AgentSizes:
    """How much the agent stages train and judge."""

    train_tasks: int = 400
    """RL task rows (their SFT chats: two per row, one when answered from memory)."""
    heldout_tasks: int = 200
    """Held-out tasks judged in the runtime."""
    sft_steps: int = 100
    """SFT optimizer steps on the tool chats."""
    rl_steps: int = 10
    """GRPO iterations on episodes."""
    max_tool_rounds: int = 1
    """Tool rounds an episode may take, in RL and in the judgement."""


def agent_recipe(run: Path, sizes: AgentSizes, device: str) -> Recipe:
    """SFT on the tool chats, then GRPO on episodes of the training tasks."""
    tasks = run / "tasks"
    return load_recipe(overrides={
        "data.path": str(tasks / "sft.jsonl"), "data.tasks": str(tasks / "train.jsonl"),
        "sft.max_steps": sizes.sft_steps, "sft.batch_size": 16, "sft.save_steps": 50,
        "rl.algo": "grpo", "rl.episodes": "on", "rl.steps": sizes.rl_steps, "rl.prompts_per_step": 4,
        "rl.group_size": 8, "rl.minibatch_size": 16, "rl.max_new_tokens": 32, "rl.temperature": 0.7,
        "rl.learning_rate": 3e-4,
        "rl.max_tool_rounds": sizes.max_tool_rounds, "rl.eval_prompts": 16, "rl.report_prompts": 0,
        "rl.watchdog.probe_prompts": 8, "compute.device": device})


def tasks_step(run: Path, sizes: AgentSizes, say: Say) -> dict:
    """The bundled tool tasks (kept when an earlier run wrote them)."""
    tasks = run / "tasks"
    say(f"[bold]7/11 tool tasks[/] {sizes.train_tasks} training and {sizes.heldout_tasks} held-out calculator "
        f"tasks (arithmetic and units), no question on both sides; the SFT chats answer {MEMORY_SHARE:.0%} of "
        "the questions from memory, as a teacher who can multiply would")
    if not all((tasks / f"{name}.jsonl").is_file() for name in FILES):
        write_agent_tasks(tasks, sizes.train_tasks, sizes.heldout_tasks, seed=0, overwrite=True,
                          memory_share=MEMORY_SHARE)
    return {name: str(tasks / f"{name}.jsonl") for name in FILES}


def agent_sft_step(recipe: Recipe, run: Path, say: Say) -> dict:
    """SFT on the tool chats (the call, the observation, the answer), exported as the baseline."""
    say(f"[bold]8/11 agent SFT[/] the call format from the task chats ({recipe.sft.max_steps} steps)")
    stage = run_sft(recipe, run, resume=True)
    m = stage.metrics
    artifact = export_policy(run, run / "export-sft")
    say(f"    {'reused' if stage.skipped else 'trained'} {stage.stage_dir}: eval loss {m['eval_loss']:.3f}; "
        f"exported {artifact}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": m, "artifact": str(artifact)}


def agent_rl_step(recipe: Recipe, run: Path, say: Say) -> dict:
    """The gate on task success, then GRPO on multi-turn episodes, exported."""
    rl = recipe.rl
    say(f"[bold]9/11 agent RL[/] gate, then GRPO on episodes run by the runtime's loop ({rl.steps} iterations "
        f"of {iteration_size(rl).samples} episodes, up to {rl.max_tool_rounds} tool round, reward {REWARD})")
    report = gate(recipe, run, adapter=None, reward_model=None, rewards=(REWARD,), force=True)
    say(f"    gate: {report['verdict']}" + "".join(f"; {reason}" for reason in report["reasons"]))
    stage = run_rl(recipe, run, rewards=[REWARD], force=True, resume=True)
    m = stage.metrics
    artifact = export_policy(run, run / "export-rl")
    say(f"    {'reused' if stage.skipped else 'trained'} {stage.stage_dir}: held-out task success SFT "
        f"{m['heldout_reward_sft']:.3f} -> RL {m['heldout_reward_rl']:.3f} (training samples); exported {artifact}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "gate": report["verdict"], "metrics": m,
            "artifact": str(artifact)}


def judge_step(run: Path, artifacts: dict[str, Path], sizes: AgentSizes, say: Say) -> dict:
    """``evaluate-agent`` on the base, SFT and RL exports (``artifacts`` in that order) over the run's held-out
    tasks: success with its interval, and the paired differences SFT - base and RL - SFT; the whole report in
    ``run/agent_report.json``."""
    say(f"[bold]10/11 evaluate-agent[/] base, SFT and RL exports in the torch-free runtime, greedy, the "
        f"calculator executed for real, on {sizes.heldout_tasks} held-out tasks")
    report = evaluate_artifacts(run / "tasks" / "heldout.jsonl", list(artifacts.values()),
                                max_tool_rounds=sizes.max_tool_rounds)
    for name, row in zip(artifacts, report["artifacts"]):
        low, high = row["success_ci95"]
        say(f"    {name}: task success {row['success_rate']:.3f} [95% CI {low:.3f}, {high:.3f}], call rate "
            f"{row['call_rate']:.2f}, valid calls {row['valid_call_rate'] or 0:.2f}")
    results = {name: [TaskResult(**r) for r in row["results"]] for name, row in zip(artifacts, report["artifacts"])}
    differences = {}
    for candidate, baseline in (("SFT", "base"), ("RL", "SFT")):
        found = compare(results[baseline], results[candidate])
        differences[f"{candidate} - {baseline}"] = found
        low, high = found["ci95"]
        say(f"    {candidate} - {baseline}: {found['success_delta']:+.3f} [95% CI {low:+.3f}, {high:+.3f}] "
            f"(paired bootstrap over tasks): {found['verdict']}")
    (run / "agent_report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    return {"artifacts": {name: _figures(row) for name, row in zip(artifacts, report["artifacts"])},
            "differences": differences}


def _figures(row: dict) -> dict:
    """An artifact's summary without its per-episode results."""
    return {key: value for key, value in row.items() if key != "results"}


def tool_turn_step(artifact: Path, store: Path, say: Say) -> dict:
    """One question to the RL agent with the built-in tools: the call, the observation, the answer; a thumbs-up
    into the store (reused when the store already holds the turn)."""
    say("[bold]11/11 agent[/] one tool turn on the RL export, one thumbs-up into the preference store")
    with PreferenceStore(store) as existing:
        turns = existing.turns()
        if turns:
            say(f"    reused turn {turns[-1].id} in {store}")
            return {"reply": turns[-1].completion, "turn_id": turns[-1].id, "store": str(store),
                    "counts": existing.counts(), "skipped": True}
    agent = Agent.load(artifact, store=store, consent=True, tools=default_tools(), max_tool_rounds=1,
                       sampling=SamplingParams(temperature=0.0, max_tokens=48))
    reply = agent.chat(QUESTION)
    agent.feedback("up")
    say(f"    you> {QUESTION}")
    for call in reply.tool_calls:
        say(f"    call> {call['name']}({json.dumps(call['arguments'])}) -> {call['content']}")
    say(f"    agent> {reply.text.strip()}")
    say(f"    recorded turn {reply.turn_id} with a thumbs-up in {store} "
        "(`slm-align feedback export` turns it into training rows)")
    return {"reply": reply.text, "tool_calls": reply.tool_calls, "turn_id": reply.turn_id, "store": str(store),
            "counts": agent.store.counts(), "skipped": False}


def base_step(run: Path) -> Path:
    """The bundled model as it ships, exported like the policies: the zero-shot baseline."""
    return export_policy(DEFAULT_MODEL_DIR, run / "export-base")


def export_policy(source: Path, out: Path) -> Path:
    """``source`` (a run: its latest policy, merged) as a parity-checked Q8_0 GGUF in ``out`` (kept when there)."""
    return Path(export_once(source, "gguf", QUANT, out)["dir"])
