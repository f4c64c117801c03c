"""The quickstart: the loop on the bundled model and the demo stories, one stage after another."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from slm_align.config import load_recipe
from slm_align.headroom import check_headroom
from slm_align.sft import run_sft


def _quiet(_: str) -> None:
    pass


def run_quickstart(out: Path, sft_steps: int = 150, say: Optional[Callable[[str], None]] = None) -> dict:
    """SFT then the headroom gate; each stage reuses its result when already done with the same inputs."""
    say = say or _quiet
    started = time.time()
    recipe = load_recipe(overrides={"sft.max_steps": sft_steps, "sft.batch_size": 16, "sft.save_steps": 50})
    say(f"[bold]1/2 SFT[/] bundled Llama model on {recipe.data.demo_documents} demo stories "
        f"(LoRA r={recipe.sft.lora.r}, NEFTune alpha={recipe.sft.neftune_alpha}, {sft_steps} steps)")
    sft = run_sft(recipe, out, resume=True)
    m = sft.metrics
    say(f"    {'reused' if sft.skipped else 'trained'} {sft.stage_dir}: train loss {m['train_loss']:.3f}, "
        f"eval loss {m['eval_loss']:.3f}")
    say("[bold]2/2 headroom gate[/] held-out perplexity of the SFT prior")
    report = check_headroom(recipe, run=out).to_dict()
    info = report["info"]
    ppl = report["figures"][0]
    say(f"    perplexity: base {info['base_ppl']:.2f} -> SFT {ppl['value']:.2f} "
        f"(threshold < {ppl['threshold']:g}): {report['verdict']}")
    for reason, remedy in zip(report["reasons"], report["remedies"]):
        say(f"    {reason}: {remedy}")
    say(f"done in {time.time() - started:.0f}s; artifacts in {out}")
    return {"out": str(out), "sft": {"dir": str(sft.stage_dir), "skipped": sft.skipped, "metrics": m},
            "headroom": report, "seconds": round(time.time() - started, 1)}
