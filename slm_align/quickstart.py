"""The quickstart: the loop on the bundled model and the demo stories, one stage after another."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from slm_align.config import load_recipe
from slm_align.evaluate import evaluate, summary_line
from slm_align.headroom import check_headroom
from slm_align.reward.stage import run_reward
from slm_align.rl.stage import run_rl
from slm_align.sft import run_sft


def _quiet(_: str) -> None:
    pass


def run_quickstart(out: Path, sft_steps: int = 150, reward_steps: int = 100, rl_steps: int = 20,
                   say: Optional[Callable[[str], None]] = None) -> dict:
    """SFT, the reward model, the headroom gate, then PPO; each stage is reused when already done with the same
    inputs."""
    say = say or _quiet
    started = time.time()
    recipe = load_recipe(overrides={"sft.max_steps": sft_steps, "sft.batch_size": 16, "sft.save_steps": 50,
                                    "reward.max_steps": reward_steps, "reward.batch_size": 16, "rl.algo": "ppo",
                                    "rl.steps": rl_steps})
    say(f"[bold]1/5 SFT[/] bundled Llama model on {recipe.data.demo_documents} demo stories "
        f"(LoRA r={recipe.sft.lora.r}, NEFTune alpha={recipe.sft.neftune_alpha}, {sft_steps} steps)")
    sft = run_sft(recipe, out, resume=True)
    m = sft.metrics
    say(f"    {'reused' if sft.skipped else 'trained'} {sft.stage_dir}: train loss {m['train_loss']:.3f}, "
        f"eval loss {m['eval_loss']:.3f}")
    say(f"[bold]2/5 reward model[/] Bradley-Terry on synthetic pairs from training stories ({reward_steps} steps)")
    reward = run_reward(recipe, out, resume=True)
    r = reward.metrics
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["accuracy_by_kind"].items())
    say(f"    {'reused' if reward.skipped else 'trained'} {reward.stage_dir}: held-out accuracy {r['accuracy']:.3f} "
        f"on {r['pairs']} unseen pairs ({kinds})")
    say("[bold]3/5 headroom gate[/] SFT perplexity, reward accuracy, reward spread over policy samples")
    report = check_headroom(recipe, run=out).to_dict()
    info = report["info"]
    say(f"    base perplexity {info['base_ppl']:.2f} -> SFT {report['figures'][0]['value']:.2f}")
    for figure in report["figures"]:
        say(f"    {figure['name']}: {figure['value']:.3f} ({figure['comparison']} {figure['threshold']:g}) "
            f"{'pass' if figure['passed'] else 'FAIL'}")
    say(f"    verdict: {report['verdict']}")
    for reason, remedy in zip(report["reasons"], report["remedies"]):
        say(f"    {reason}: {remedy}")
    result = {"out": str(out), "sft": {"dir": str(sft.stage_dir), "skipped": sft.skipped, "metrics": m},
              "reward": {"dir": str(reward.stage_dir), "skipped": reward.skipped, "metrics": r}, "headroom": report}
    if report["passed"]:
        say(f"[bold]4/5 RL[/] PPO in the safety envelope ({rl_steps} iterations of "
            f"{recipe.rl.prompts_per_step * recipe.rl.group_size} samples)")
        rl = run_rl(recipe, out, resume=True)
        curve = [json.loads(line)["reward/mean"] for line in (rl.stage_dir / "metrics.jsonl").read_text().splitlines()]
        g = rl.metrics["guard"]
        say(f"    {'reused' if rl.skipped else 'trained'} {rl.stage_dir}: training reward {curve[0]:.2f} -> "
            f"{curve[-1]:.2f}; held-out reward SFT {rl.metrics['heldout_reward_sft']:.3f} -> RL "
            f"{rl.metrics['heldout_reward_rl']:.3f} ({rl.metrics['heldout_reward_delta']:+.3f}); guard skips "
            f"{g['skipped']}, rollbacks {g['rollbacks']}; plots in {rl.stage_dir / 'plots'}")
        result["rl"] = {"dir": str(rl.stage_dir), "skipped": rl.skipped, "metrics": rl.metrics, "reward_curve": curve}
        say("[bold]5/5 evaluation[/] SFT vs RL on held-out prompts under the shared reward model")
        report = evaluate(recipe, out)
        for comparison in report["comparisons"]:
            say(f"    {summary_line(comparison)}")
        say(f"    report: {Path(out) / 'eval' / 'report.md'}")
        result["evaluation"] = report["comparisons"]
    say(f"done in {time.time() - started:.0f}s; artifacts in {out}")
    return dict(result, seconds=round(time.time() - started, 1))
