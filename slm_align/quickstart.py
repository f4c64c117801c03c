"""The quickstart: the loop on the bundled model and the demo stories, one stage after another."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from slm_align.config import load_recipe
from slm_align.headroom import check_headroom
from slm_align.reward.stage import run_reward
from slm_align.sft import run_sft


def _quiet(_: str) -> None:
    pass


def run_quickstart(out: Path, sft_steps: int = 150, reward_steps: int = 100,
                   say: Optional[Callable[[str], None]] = None) -> dict:
    """SFT, the reward model, then the headroom gate; each stage is reused when already done with the same inputs."""
    say = say or _quiet
    started = time.time()
    recipe = load_recipe(overrides={"sft.max_steps": sft_steps, "sft.batch_size": 16, "sft.save_steps": 50,
                                    "reward.max_steps": reward_steps, "reward.batch_size": 16})
    say(f"[bold]1/3 SFT[/] bundled Llama model on {recipe.data.demo_documents} demo stories "
        f"(LoRA r={recipe.sft.lora.r}, NEFTune alpha={recipe.sft.neftune_alpha}, {sft_steps} steps)")
    sft = run_sft(recipe, out, resume=True)
    m = sft.metrics
    say(f"    {'reused' if sft.skipped else 'trained'} {sft.stage_dir}: train loss {m['train_loss']:.3f}, "
        f"eval loss {m['eval_loss']:.3f}")
    say(f"[bold]2/3 reward model[/] Bradley-Terry on synthetic pairs from training stories ({reward_steps} steps)")
    reward = run_reward(recipe, out, resume=True)
    r = reward.metrics
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["accuracy_by_kind"].items())
    say(f"    {'reused' if reward.skipped else 'trained'} {reward.stage_dir}: held-out accuracy {r['accuracy']:.3f} "
        f"on {r['pairs']} unseen pairs ({kinds})")
    say("[bold]3/3 headroom gate[/] SFT perplexity, reward accuracy, reward spread over policy samples")
    report = check_headroom(recipe, run=out).to_dict()
    info = report["info"]
    say(f"    base perplexity {info['base_ppl']:.2f} -> SFT {report['figures'][0]['value']:.2f}")
    for figure in report["figures"]:
        say(f"    {figure['name']}: {figure['value']:.3f} ({figure['comparison']} {figure['threshold']:g}) "
            f"{'pass' if figure['passed'] else 'FAIL'}")
    say(f"    verdict: {report['verdict']}")
    for reason, remedy in zip(report["reasons"], report["remedies"]):
        say(f"    {reason}: {remedy}")
    say(f"done in {time.time() - started:.0f}s; artifacts in {out}")
    return {"out": str(out), "sft": {"dir": str(sft.stage_dir), "skipped": sft.skipped, "metrics": m},
            "reward": {"dir": str(reward.stage_dir), "skipped": reward.skipped, "metrics": r},
            "headroom": report, "seconds": round(time.time() - started, 1)}
