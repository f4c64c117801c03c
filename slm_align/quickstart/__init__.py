"""The quickstart: the whole loop on the bundled model, one stage after another, each stage's seconds recorded.

The story stages (:mod:`.stories`) align the model to a learned reward on the demo stories; the agent stages
(:mod:`.agent`) make it a better calculator agent, judged in the runtime that runs it. Each stage is reused when
already done with the same inputs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from slm_align.progress import quiet
from slm_align.quickstart import agent, stories
from slm_align.runs import check_out_dir

NEXT_COMMANDS = (
    "slm-align tasks make --out data/calc          # or your own task rows: prompt, tools, answer",
    "slm-align train --model YOUR_MODEL --data data/calc/sft.jsonl --tasks data/calc/train.jsonl --reward "
    "task_success --algo grpo --out runs/mine",
    "slm-align export runs/mine --target gguf && slm-align evaluate-agent data/calc/heldout.jsonl "
    "--artifact runs/mine/export/model-Q8_0.gguf",
)
"""What the last lines tell the user to run on their own model."""


class StageClock:
    """Each stage's wall seconds, in the order the stages ran."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run(self, name: str, step: Callable, *args):
        """``step(*args)``, its wall seconds recorded under ``name``."""
        started = time.perf_counter()
        result = step(*args)
        self.seconds[name] = round(time.perf_counter() - started, 1)
        return result


def run_quickstart(out: Path, sft_steps: int = 150, reward_steps: int = 100, rl_steps: int = 20,
                   say: Optional[Callable[[str], None]] = None, device: str = "auto",
                   sizes: agent.AgentSizes = agent.AgentSizes()) -> dict:
    """The story stages, then the agent stages on ``out/agent``; the result of each, and ``seconds`` per stage."""
    say = say or quiet
    started = time.time()
    check_out_dir(out)  # before the first progress line
    out = Path(out)
    clock = StageClock()
    recipe = stories.story_recipe(sft_steps, reward_steps, rl_steps, device)
    result = {"out": str(out), "sft": clock.run("sft", stories.sft_step, recipe, out, say),
              "reward": clock.run("reward", stories.reward_step, recipe, out, say)}
    result["headroom"] = clock.run("headroom", stories.gate_step, recipe, out, say)
    if result["headroom"]["passed"]:
        result["rl"] = clock.run("rl", stories.rl_step, recipe, out, say)
        result["evaluation"] = clock.run("evaluation", stories.evaluation_step, recipe, out, say)
        result["export"] = clock.run("export", stories.export_step, out, say)
        result["agent"] = _agent_stages(out / "agent", sizes, device, clock, say)
        result["tool_turn"] = clock.run("tool_turn", agent.tool_turn_step, Path(result["agent"]["rl"]["artifact"]),
                                        out / "preferences.db", say)
        say("next, on your own model:")
        for command in NEXT_COMMANDS:
            say(f"    {command}")
    say("seconds per stage: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in clock.seconds.items()))
    say(f"done in {time.time() - started:.0f}s; artifacts in {out}")
    return dict(result, seconds=round(time.time() - started, 1), stage_seconds=clock.seconds)


def _agent_stages(run: Path, sizes: agent.AgentSizes, device: str, clock: StageClock, say) -> dict:
    """Tasks, SFT, gate and GRPO, the three exports judged by evaluate-agent; each stage timed on ``clock``."""
    files = clock.run("agent_tasks", agent.tasks_step, run, sizes, say)
    recipe = agent.agent_recipe(run, sizes, device)
    sft = clock.run("agent_sft", agent.agent_sft_step, recipe, run, say)
    rl = clock.run("agent_rl", agent.agent_rl_step, recipe, run, say)
    artifacts = {"base": clock.run("agent_base", agent.base_step, run), "SFT": Path(sft["artifact"]),
                 "RL": Path(rl["artifact"])}
    judged = clock.run("evaluate_agent", agent.judge_step, run, artifacts, sizes, say)
    return {"tasks": files, "sft": sft, "rl": rl, "evaluation": judged}
