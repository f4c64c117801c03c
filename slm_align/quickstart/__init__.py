"""The quickstart: function calling on the bundled model with a few demonstrations and many checked
prompts, one stage after another, each stage's seconds recorded (:mod:`.agent`). Each stage is
reused when already done with the same inputs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from slm_align.progress import quiet
from slm_align.quickstart import agent
from slm_align.runs import check_out_dir

NEXT_COMMANDS = (
    "slm-align tasks make --kind functions --out data/fn   "
    "# or your own rows: messages, tools, ground_truth",
    "slm-align train --model YOUR_MODEL --data data/fn/sft.jsonl --tasks data/fn/train.jsonl "
    "--reward function_call_match --algo grpo --out runs/mine",
    "slm-align export runs/mine --target gguf && slm-align evaluate-agent data/fn/heldout.jsonl "
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


def run_quickstart(out: Path, sft_steps: Optional[int] = None, rl_steps: Optional[int] = None,
                   say: Optional[Callable[[str], None]] = None, device: str = "auto",
                   sizes: agent.AgentSizes = agent.AgentSizes()) -> dict:
    """Tasks, SFT on the few demonstrations, the gate and GRPO, the three exports judged by
    evaluate-agent; the result of each, ``seconds`` and ``stage_seconds``.
    ``sft_steps``/``rl_steps`` override ``sizes``."""
    say = say or quiet
    started = time.time()
    check_out_dir(out)  # before the first progress line
    run = Path(out)
    sizes = replace(sizes, sft_steps=sft_steps or sizes.sft_steps,
                    rl_steps=rl_steps or sizes.rl_steps)
    clock = StageClock()
    result = {"out": str(run), "tasks": clock.run("tasks", agent.tasks_step, run, sizes, say)}
    recipe = agent.agent_recipe(run, sizes, device)
    result["sft"] = clock.run("sft", agent.sft_step, recipe, run, sizes, say)
    result["rl"] = clock.run("rl", agent.rl_step, recipe, run, say)
    artifacts = {"base": clock.run("base", agent.base_step, run),
                 "SFT": Path(result["sft"]["artifact"]), "RL": Path(result["rl"]["artifact"])}
    result["evaluation"] = clock.run("evaluate_agent", agent.judge_step, run, artifacts, sizes, say)
    say("next, on your own model:")
    for command in NEXT_COMMANDS:
        say(f"    {command}")
    say("seconds per "
        "stage: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in clock.seconds.items()))
    say(f"done in {time.time() - started:.0f}s; artifacts in {run}")
    return dict(result, seconds=round(time.time() - started, 1), stage_seconds=clock.seconds)
