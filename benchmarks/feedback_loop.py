"""The loop, closed: chat -> feedback -> `feedback export` -> DPO and KTO -> export ->
chat, measured in the runtime.

A simulated app user chats with the exported SFT model (the bundled model after a short SFT, or
--model) through the agent runtime with a preference store, and gives feedback whose signal is
learnable: every edit and every picked alternative opens with "Yes, indeed.", and answers
without it get a thumbs-down. The store is exported (both files, each row carrying the model_id
it was given to), DPO and KTO each train one round on it from the run's SFT prior, and each
result is exported again. Then, in the runtime (llama.cpp, no torch), the old and the new
artifacts score the held-out pairs: the share where the chosen answer gets the higher
log-probability, with a 95% Wilson interval.

    python benchmarks/feedback_loop.py                    # 60 turns, bundled model
    python benchmarks/feedback_loop.py --turns 120 --steps 60
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

PROPERTY = "Yes, indeed. "
"""What the simulated user's preferred answers open with (and the model's own answers lack)."""


def user_prompts(count: int) -> list[str]:
    """Openings of demo stories, one per turn."""
    from slm_align.config import DataSettings
    from slm_align.data.corpus import load_corpus
    from slm_align.data.prompts import split_opening

    prompts = []
    for example in load_corpus(DataSettings(demo_documents=4 * count), seed=1).splits.train:
        split = split_opening(example.text or "", 1)
        if split is not None:
            prompts.append("Continue the story: " + split[0])
        if len(prompts) == count:
            break
    return prompts


def record_feedback(artifact: Path, store: Path, turns: int, max_tokens: int = 16) -> dict:
    """Chat ``turns`` single-turn conversations and give feedback on each: an edit, a pick of an
    alternative, or a thumbs-down, in turn. Returns how many of each were given."""
    from slm_align.ondevice.agent.runtime import Agent

    agent = Agent.load(artifact, store=store, consent=True)
    given = {"edit": 0, "choice": 0, "down": 0}
    for index, prompt in enumerate(user_prompts(turns)):
        agent.reset()
        reply = agent.chat(prompt, max_tokens=max_tokens, seed=index)
        kind = ("edit", "choice", "down")[index % 3]
        if kind == "edit":
            agent.feedback("edit", text=PROPERTY + reply.text.strip())
        elif kind == "choice":
            agent.feedback("choice", other=PROPERTY + reply.text.strip(), preferred="other")
        else:
            agent.feedback("down")
        given[kind] += 1
    return given


def export_run(run: Path, out: Path) -> Path:
    """The run (its latest aligned stage merged) as an F32 GGUF in ``out``."""
    from slm_align.export.publishing.stage import ExportRequest, run_export

    return run_export(ExportRequest(str(run), "gguf", "F32", out=out, verify=False)).stage_dir


def train_round(recipe, run: Path, algo: str, files: list[Path], steps: int, learning_rate: float) -> dict:
    """One DPO or KTO round on the exported feedback, from the run's SFT prior (the gate
    forced: a short demo)."""
    from slm_align.pipeline import run_preference

    preference = recipe.preference.model_copy(update={"steps": steps, "learning_rate": learning_rate})
    recipe = recipe.model_copy(update={"rl": recipe.rl.model_copy(update={"algo": algo}), "preference": preference,
                                       "reward": recipe.reward.model_copy(update={"preferences": list(map(str,
                                                                                                          files))})})
    return run_preference(recipe, run, force=True).metrics


def heldout_pairs(recipe, files: list[Path]) -> list:
    """The held-out pairs of the preference split (the prompts neither round trained on)."""
    from slm_align.modeling.models import load_tokenizer, resolve_source
    from slm_align.preference.data import load_preference_data

    tokenizer = load_tokenizer(resolve_source(recipe.model.source))
    data = load_preference_data(files, tokenizer, "dpo", recipe.seed, recipe.preference.heldout_fraction)
    return data.heldout_pairs


def close_the_loop(work: Path, turns: int, steps: int, learning_rate: float, sft_steps: int,
                   model: str | None = None) -> dict:
    """Run the whole loop in ``work``; returns, per artifact (sft, dpo, kto), the
    held-out pairs it prefers."""
    from slm_align.data.demo_corpus import write_demo_corpus
    from slm_align.modeling.models import DEFAULT_MODEL_DIR
    from slm_align.ondevice.agent.feedback_export import export_preferences, unpaired_path
    from slm_align.ondevice.agent.preference_probe import preferred_count
    from slm_align.stats import wilson_interval
    from tests.helpers import finished_sft_run

    corpus = write_demo_corpus(work / "stories.txt", n=200, seed=3)
    run, recipe = finished_sft_run(work / "run", Path(model or DEFAULT_MODEL_DIR), corpus, steps=sft_steps)
    artifacts = {"sft": export_run(run, run / "export")}
    given = record_feedback(artifacts["sft"], work / "prefs.db", turns)
    exported = export_preferences(work / "prefs.db", work / "prefs.jsonl")
    files = [work / "prefs.jsonl", unpaired_path(work / "prefs.jsonl")]
    rounds = {}
    for algo in ("dpo", "kto"):
        rounds[algo] = train_round(recipe, run, algo, files, steps, learning_rate)
        artifacts[algo] = export_run(run, work / f"export-{algo}")
    pairs = heldout_pairs(recipe, files)
    shares = {}
    for name, artifact in artifacts.items():
        wins = preferred_count(artifact, pairs)
        shares[name] = {"wins": wins, "pairs": len(pairs), "share": wins / len(pairs),
                        "ci95": wilson_interval(wins, len(pairs))}
    return {"feedback": given, "exported": exported, "rounds": rounds, "runtime_preference": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--model", default=None, help="base model (default: the bundled model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = close_the_loop(Path(work), args.turns, args.steps, args.lr, args.sft_steps, args.model)
    print(f"feedback given: {result['feedback']}; exported {result['exported']['pairs']} pairs and "
          f"{result['exported']['unpaired']} thumbs")
    print(f"{'artifact':10}{'prefers chosen':>16}{'95% CI':>18}")
    for name, share in result["runtime_preference"].items():
        low = share["ci95"][0]
        high = share["ci95"][1]
        print(f"{name:10}{share['wins']:>8}/{share['pairs']:<7}{share['share']:.3f} "
              f"[{low:.3f}, {high:.3f}]")
    print(json.dumps({algo: r["heldout_accuracy"] for algo, r in result["rounds"].items()}))


if __name__ == "__main__":
    main()
