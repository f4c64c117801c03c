"""The quickstart's story stages: SFT on the demo stories, the reward model, the gate, PPO, evaluation under
the reward model, and the parity-checked exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from slm_align.config import Recipe, load_recipe
from slm_align.evaluate.stage import summary_line
from slm_align.pipeline import evaluate, export_once, gate, run_reward, run_rl, run_sft
from slm_align.rl.schedule import iteration_size


def story_recipe(sft_steps: int, reward_steps: int, rl_steps: int, device: str) -> Recipe:
    """The story stages' recipe: the bundled model and the demo stories, PPO on the learned reward."""
    return load_recipe(overrides={"sft.max_steps": sft_steps, "sft.batch_size": 16, "sft.save_steps": 50,
                                  "reward.max_steps": reward_steps, "reward.batch_size": 16, "rl.algo": "ppo",
                                  "rl.steps": rl_steps, "compute.device": device})


def _done(stage) -> str:
    return "reused" if stage.skipped else "trained"


def sft_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    sft = recipe.sft
    say(f"[bold]1/11 SFT[/] bundled Llama model on {recipe.data.demo_documents} demo stories "
        f"(LoRA r={sft.lora.r}, NEFTune alpha={sft.neftune_alpha}, {sft.max_steps} steps)")
    stage = run_sft(recipe, out, resume=True)
    m = stage.metrics
    say(f"    {_done(stage)} {stage.stage_dir}: train loss {m['train_loss']:.3f}, eval loss "
        f"{m['eval_loss']:.3f}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": m}


def reward_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    say(f"[bold]2/11 reward model[/] Bradley-Terry on synthetic pairs from training stories "
        f"({recipe.reward.max_steps} steps)")
    stage = run_reward(recipe, out, resume=True)
    r = stage.metrics
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["accuracy_by_kind"].items())
    say(f"    {_done(stage)} {stage.stage_dir}: held-out accuracy {r['accuracy']:.3f} "
        f"on {r['pairs']} unseen pairs ({kinds})")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": r}


def gate_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    say("[bold]3/11 headroom gate[/] SFT perplexity, reward accuracy, reward spread within prompts")
    report = gate(recipe, out, adapter=None, reward_model=None, rewards=(), force=True)
    say(f"    base perplexity {report['info']['base_ppl']:.2f} -> SFT "
        f"{report['figures'][0]['value']:.2f}")
    for figure in report["figures"]:
        verdict = "pass" if figure["passed"] else "FAIL"
        say(f"    {figure['name']}: {figure['value']:.3f} ({figure['comparison']} "
            f"{figure['threshold']:g}) {verdict}")
    say(f"    verdict: {report['verdict']}")
    for reason, remedy in zip(report["reasons"], report["remedies"]):
        say(f"    {reason}: {remedy}")
    if "recommendation" in report["info"]:
        say(f"    advice: {report['info']['recommendation']['why']}")
    return report


def rl_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    say(f"[bold]4/11 RL[/] PPO in the safety envelope ({recipe.rl.steps} iterations of "
        f"{iteration_size(recipe.rl).samples} samples)")
    stage = run_rl(recipe, out, resume=True)
    lines = (stage.stage_dir / "metrics.jsonl").read_text().splitlines()
    curve = [json.loads(line)["reward/mean"] for line in lines]
    m = stage.metrics
    g = m["guard"]
    say(f"    {_done(stage)} {stage.stage_dir}: training reward {curve[0]:.2f} -> "
        f"{curve[-1]:.2f}; held-out reward SFT {m['heldout_reward_sft']:.3f} -> RL "
        f"{m['heldout_reward_rl']:.3f} ({m['heldout_reward_delta']:+.3f}); guard skips "
        f"{g['skipped']}, rollbacks {g['rollbacks']}; plots in {stage.stage_dir / 'plots'}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": m, "reward_curve": curve}


def evaluation_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> list:
    say("[bold]5/11 evaluation[/] SFT vs RL on held-out prompts under the shared reward model")
    report = evaluate(recipe, out)
    for comparison in report["comparisons"]:
        say(f"    {summary_line(comparison)}")
    say(f"    report: {Path(out) / 'eval' / 'report.md'}")
    return report["comparisons"]


def export_step(out: Path, say: Callable[[str], None]) -> dict:
    say("[bold]6/11 export[/] merged model to GGUF Q8_0 (llama.cpp) and ONNX fp32 "
        "(onnxruntime), parity-checked")
    done = {}
    # ONNX dynamic int8 loses too much on a 2.5M-parameter model (top-1 agreement ~0.82, which
    # verification refuses); fp32 shows the exact path.
    for target, quant in (("gguf", "Q8_0"), ("onnx", "fp32")):
        summary = export_once(out, target, quant)
        done[target] = summary
        m = summary["metrics"]
        v = m["verification"]
        greedy = f"greedy {v['greedy_exact']}/{v['prompts']} prompts identical, " if v["prompts"] else ""
        tokenizer = "identical" if v["tokenizer_match"] else "DIFFERENT"
        say(f"    {summary['dir']}: {m['bytes'] / 1e6:.1f} MB; tokenizer {tokenizer}, "
            f"{greedy}top-1 agreement {v['agreement']:.3f}")
    return done
