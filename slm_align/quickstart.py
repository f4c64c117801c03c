"""The quickstart: the loop on the bundled model and the demo stories, one stage after another."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from slm_align.config import Recipe, load_recipe
from slm_align.evaluate import summary_line
from slm_align.pipeline import evaluate, export_once, gate, run_reward, run_rl, run_sft
from slm_align.progress import quiet
from slm_align.rl.schedule import iteration_size
from slm_align.runs import check_out_dir


def run_quickstart(out: Path, sft_steps: int = 150, reward_steps: int = 100, rl_steps: int = 20,
                   say: Optional[Callable[[str], None]] = None, device: str = "auto") -> dict:
    """SFT, the reward model, the headroom gate, then PPO, evaluation, export and one agent turn;
    each stage is reused when already done with the same inputs."""
    say = say or quiet
    started = time.time()
    check_out_dir(out)  # before the first progress line
    recipe = load_recipe(overrides={"sft.max_steps": sft_steps, "sft.batch_size": 16, "sft.save_steps": 50,
                                    "reward.max_steps": reward_steps, "reward.batch_size": 16, "rl.algo": "ppo",
                                    "rl.steps": rl_steps, "compute.device": device})
    result = {"out": str(out), "sft": _sft_step(recipe, out, say), "reward": _reward_step(recipe, out, say)}
    result["headroom"] = _gate_step(recipe, out, say)
    if result["headroom"]["passed"]:
        result["rl"] = _rl_step(recipe, out, say)
        result["evaluation"] = _evaluation_step(recipe, out, say)
        result["export"] = _export_step(out, say)
        result["agent"] = _agent_step(Path(result["export"]["gguf"]["dir"]), Path(out) / "preferences.db", say)
    say(f"done in {time.time() - started:.0f}s; artifacts in {out}")
    return dict(result, seconds=round(time.time() - started, 1))


def _done(stage) -> str:
    return "reused" if stage.skipped else "trained"


def _sft_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    sft = recipe.sft
    say(f"[bold]1/7 SFT[/] bundled Llama model on {recipe.data.demo_documents} demo stories "
        f"(LoRA r={sft.lora.r}, NEFTune alpha={sft.neftune_alpha}, {sft.max_steps} steps)")
    stage = run_sft(recipe, out, resume=True)
    m = stage.metrics
    say(f"    {_done(stage)} {stage.stage_dir}: train loss {m['train_loss']:.3f}, eval loss "
        f"{m['eval_loss']:.3f}")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": m}


def _reward_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    say(f"[bold]2/7 reward model[/] Bradley-Terry on synthetic pairs from training stories "
        f"({recipe.reward.max_steps} steps)")
    stage = run_reward(recipe, out, resume=True)
    r = stage.metrics
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["accuracy_by_kind"].items())
    say(f"    {_done(stage)} {stage.stage_dir}: held-out accuracy {r['accuracy']:.3f} "
        f"on {r['pairs']} unseen pairs ({kinds})")
    return {"dir": str(stage.stage_dir), "skipped": stage.skipped, "metrics": r}


def _gate_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    say("[bold]3/7 headroom gate[/] SFT perplexity, reward accuracy, reward spread within prompts")
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


def _rl_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> dict:
    say(f"[bold]4/7 RL[/] PPO in the safety envelope ({recipe.rl.steps} iterations of "
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


def _evaluation_step(recipe: Recipe, out: Path, say: Callable[[str], None]) -> list:
    say("[bold]5/7 evaluation[/] SFT vs RL on held-out prompts under the shared reward model")
    report = evaluate(recipe, out)
    for comparison in report["comparisons"]:
        say(f"    {summary_line(comparison)}")
    say(f"    report: {Path(out) / 'eval' / 'report.md'}")
    return report["comparisons"]


def _export_step(out: Path, say: Callable[[str], None]) -> dict:
    say("[bold]6/7 export[/] merged model to GGUF Q8_0 (llama.cpp) and ONNX fp32 "
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


def _agent_step(artifact: Path, store: Path, say: Callable[[str], None]) -> dict:
    """One turn of the torch-free agent on the exported model, and one stored preference (reused
    when the quickstart's store already holds it)."""
    from slm_align.agent.runtime import Agent
    from slm_align.agent.sampling import SamplingParams
    from slm_align.agent.store import PreferenceStore

    say("[bold]7/7 agent[/] one turn on the exported GGUF, one thumbs-up into the preference store")
    message = "Tell me a story about a fox."
    with PreferenceStore(store) as existing:
        turns = existing.turns()
        if turns:
            say(f"    reused turn {turns[-1].id} in {store}")
            return {"reply": turns[-1].completion, "turn_id": turns[-1].id, "store": str(store),
                    "counts": existing.counts(), "skipped": True}
    agent = Agent.load(artifact, store=store, consent=True, sampling=SamplingParams(temperature=0.7, max_tokens=48))
    reply = agent.chat(message)
    agent.feedback("up")
    say(f"    you> {message}\n    model> {reply.text.strip()}")
    say(f"    recorded turn {reply.turn_id} with a thumbs-up in {store} "
        "(`slm-align feedback export` turns it into training rows)")
    return {"reply": reply.text, "turn_id": reply.turn_id, "store": str(store), "counts": agent.store.counts(),
            "skipped": False}
