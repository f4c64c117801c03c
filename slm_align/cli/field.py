"""``slm-align field simulate``: simulated devices answer held-out tasks and write the stores a fleet sends."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from slm_align.cli.options import JsonFlag, ThreadsOpt
from slm_align.cli.render import emit, stdout

field_app = typer.Typer(help="Try a round in the field before it ships: simulated devices with scripted users.",
                        no_args_is_help=True)


@field_app.command("simulate", epilog="Examples:\n\n  slm-align field simulate --artifact "
                   "runs/demo/export/model-Q8_0.gguf --tasks data/calc/heldout.jsonl --devices 20 --out "
                   "field1\n\n  slm-align feedback collect field1/*.db --out round2   # the next round's rows"
                   "\n\n  slm-align field simulate --artifact runs/demo/export/adapter-sft-F16.gguf.json "
                   "--candidate runs/round2/export/adapter-dpo-F16.gguf --tasks data/fn/heldout.jsonl "
                   "--devices 40 --noise 0.1 --unrated 0.5 --out ab1 --json\n\n  slm-align feedback ab "
                   "ab1/*.db   # the fleet's A/B decision")
def simulate(
    artifact: str = typer.Option(..., "--artifact", help="The round the devices run: a .gguf, an ONNX export "
                                 "directory, BASE.gguf+ADAPTER.gguf, an adapter export's manifest "
                                 "(adapter-*.gguf.json) or a bundle folder."),
    tasks: Path = typer.Option(..., "--tasks", help="Held-out task rows (`tasks make`: calculator rows "
                               "with an answer, or function rows with ground_truth)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for one preference store per device "
                             "(device-001.db, ...) and summary.json."),
    devices: int = typer.Option(8, "--devices", help="Simulated devices (an integer >= 1)."),
    turns_per_device: int = typer.Option(20, "--turns-per-device", help="Conversations per device, each "
                                         "one task drawn for that device."),
    noise: float = typer.Option(0.1, "--noise", help="Share of rated turns whose thumb is flipped (0 to 1)."),
    unrated: float = typer.Option(0.3, "--unrated", help="Share of turns the user does not rate (0 to 1)."),
    candidate: Optional[list[str]] = typer.Option(None, "--candidate", help="LoRA adapter GGUF to A/B-test "
                                                  "against the artifact's adapters on every device, as the "
                                                  "embedded runtime does (repeat to chain); or one adapter "
                                                  "export's manifest or bundle folder on the same base."),
    candidate_share: float = typer.Option(0.5, "--candidate-share", help="Share of conversations the "
                                          "candidate answers while a device's A/B test collects."),
    seed: int = typer.Option(0, "--seed", help="Seed of each device's tasks, its user's ratings and "
                             "its sampling."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use the first N task rows only."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", help="Most tokens per model reply."),
    max_tool_rounds: int = typer.Option(3, "--max-tool-rounds", help="Tool rounds a turn may take before "
                                        "its final answer."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 answers greedily; above, each turn "
                                      "is sampled with its own seed (0 to 2)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing, non-empty --out folder."),
    threads: Optional[int] = ThreadsOpt,
    as_json: bool = JsonFlag,
) -> None:
    """Run simulated devices on held-out tasks in the runtime, each with a scripted user who rates an
    answer by the task's checker (up when right, down when wrong, with noise and unrated turns), and
    write one preference store per device: the files a fleet sends to `feedback collect` and
    `feedback ab`."""
    from slm_align.ondevice.agent.field import simulate_field

    summary = simulate_field(artifact, tasks, out, devices=devices, turns_per_device=turns_per_device,
                             noise=noise, unrated=unrated, candidate=candidate or (),
                             candidate_share=candidate_share, seed=seed, limit=limit,
                             max_tokens=max_new_tokens, max_tool_rounds=max_tool_rounds,
                             temperature=temperature, threads=threads, overwrite=overwrite)
    emit(as_json, summary, lambda: print_field(summary))


def print_field(summary: dict) -> None:
    """A line for the fleet's ratings, one per arm with its task success."""
    stdout.print(f"[bold]field simulate[/] -> {summary['out']}: {summary['devices']} devices, "
                 f"{summary['turns']} turns, {summary['rated']} rated ({summary['ups']} up, {summary['downs']} "
                 f"down, {summary['flipped']} flipped by noise), {summary['unrated_turns']} unrated")
    for name, arm in summary["arms"].items():
        low, high = arm["success_ci95"]
        stdout.print(f"  {name}: task success {arm['successes']}/{arm['turns']} = {arm['success_rate']:.2f} "
                     f"[{low:.2f}, {high:.2f}]")
    if summary["ab"]:
        decisions = ", ".join(f"{state} {count}" for state, count in summary["ab"]["device_decisions"].items())
        stdout.print(f"  devices' own A/B states: {decisions}; decide for the fleet with "
                     f"`slm-align feedback ab {summary['out']}/*.db`")
