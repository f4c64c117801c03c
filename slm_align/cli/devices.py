"""Device commands: profiles, fit / speed estimates (``devices ...``) and measurements on
this host (``bench``)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import typer

from slm_align.cli.options import CTX_NAMES, JsonFlag, ThreadsOpt
from slm_align.cli.render import emit, print_bench, print_device, print_fit, rows_table, stdout

commands = typer.Typer()
devices_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="markdown",
    help="Device profiles and fit / speed estimates: will this model run on "
         "my board, and how fast?",
    epilog="Examples:\n\n  slm-align devices list\n\n  slm-align devices show rpi5 --json\n\n"
           "  slm-align devices fit runs/demo/merged --device rpi5 --quant Q4_0 --ctx 2048")


@devices_app.command("list", epilog="Examples:\n\n  slm-align devices list\n\n  slm-align devices "
                                    "list --json\n\n  SLM_ALIGN_DEVICES=./my-devices slm-align "
                                    "devices list   # your own TOML files")
def devices_list(as_json: bool = JsonFlag) -> None:
    """List the device profiles: bundled, ~/.config/slm-align/devices/ and
    $SLM_ALIGN_DEVICES (user files win)."""
    from slm_align.ondevice.devices import list_profiles, load_profile

    rows = [{"name": p.name, "device": p.display_name, "ram_gb": p.ram_gb, "bandwidth_gbs": p.bandwidth_gbs,
             "runtime": p.runtime, "quant": p.gguf_quant, "reference_points": len(p.reference)}
            for p in map(load_profile, list_profiles())]
    table = partial(rows_table, "Device profiles", rows, whole=("name", "quant"))  # names one types
    emit(as_json, {"devices": rows}, lambda: stdout.print(table()))


@devices_app.command("show", epilog="Examples:\n\n  slm-align devices show rpi5\n\n"
                                    "  slm-align devices show x86-laptop --json")
def devices_show(name: str = typer.Argument(..., help="Profile name (see `slm-align devices list`)."),
                 as_json: bool = JsonFlag) -> None:
    """Show one device profile with its published reference measurements and their sources."""
    from slm_align.ondevice.devices import load_profile

    profile = load_profile(name).model_dump()
    emit(as_json, profile, lambda: print_device(profile))


@devices_app.command("fit", epilog="Examples:\n\n  slm-align devices fit runs/demo/merged --device "
                                   "rpi5\n\n  slm-align devices fit model.gguf --device rpi-zero2w "
                                   "--ctx 1024\n\n  slm-align devices fit runs/demo/export/onnx "
                                   "--device android-mid --quant int8 --json")
def devices_fit(
    model: Path = typer.Argument(..., help="HF directory (safetensors), .gguf file or "
                                           "ONNX export directory."),
    device: str = typer.Option(..., "--device", help="Device profile name (see "
                                                     "`slm-align devices list`)."),
    quant: Optional[str] = typer.Option(None, "--quant", help="Weight type, e.g. Q4_0, Q4_K_M, "
                                                              "Q8_0, F16, int8 (default: the "
                                                              "device's preference, downgraded to fit)."),
    context: Optional[int] = typer.Option(None, *CTX_NAMES, help="Context length in tokens "
                                                                  "(default: 4096 or the "
                                                                  "model's own, if shorter)."),
    as_json: bool = JsonFlag,
) -> None:
    """Estimate memory, verdict (fits / tight / does not fit), largest context and
    decode speed on a device."""
    from slm_align.ondevice.devices import estimate_fit, load_profile, model_facts

    profile = load_profile(device)
    report = estimate_fit(model_facts(model), profile, quant, context).to_dict()
    emit(as_json, report, lambda: print_fit(report))


@commands.command(epilog="Examples:\n\n  slm-align bench runs/demo/export/model-Q8_0.gguf\n\n  "
                         "slm-align bench runs/demo/export/onnx-int8 --threads 4 --prompt-tokens "
                         "256 --repeats 5\n\n  slm-align bench model-Q8_0.gguf --save-profile "
                         "my-laptop     # then: devices fit ... --device my-laptop\n\n  slm-align "
                         "bench model-Q8_0.gguf --device x86-laptop --json    "
                         "# measured vs predicted")
def bench(
    artifact: Path = typer.Argument(..., help="Exported model: a .gguf file or an "
                                              "ONNX export directory."),
    threads: Optional[int] = ThreadsOpt,
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="Prompt length fed at once."),
    decode_tokens: int = typer.Option(64, "--decode-tokens", min=1, help="Tokens generated after the first one."),
    repeats: int = typer.Option(3, min=1, help="Measurement repeats (speeds are medians)."),
    n_ctx: Optional[int] = typer.Option(None, *CTX_NAMES, min=16, help="Context window (default: the model's own)."),
    device: Optional[str] = typer.Option(None, "--device", help="Also show `devices fit`'s decode "
                                                               "prediction for this profile, and "
                                                               "measured / predicted."),
    save_profile: Optional[str] = typer.Option(None, "--save-profile", help="Save this host as a user device profile "
                                               "NAME ($SLM_ALIGN_DEVICES or "
                                               "~/.config/slm-align/devices/)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing profile of that name."),
    as_json: bool = JsonFlag,
) -> None:
    """Measure an exported model on this host: load time, time to first token, prompt and
    decode tokens/s, peak RAM."""
    from slm_align.ondevice.agent.bench import BenchPlan, run_bench

    plan = BenchPlan(threads, prompt_tokens, decode_tokens, repeats, n_ctx)
    summary = run_bench(artifact, plan, device=device, save_as=save_profile, overwrite=overwrite)
    emit(as_json, summary, lambda: print_bench(summary))
