"""``slm-align bundle``: a device bundle (directory and zip) of an exported
model for an app developer."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import typer

from slm_align.cli.options import OUT_NAMES, JsonFlag
from slm_align.cli.render import emit

commands = typer.Typer()

EPILOG = ("Examples:\n\n  slm-align bundle runs/demo --device iphone-15-pro   # exports Q4_K_M first if needed\n\n"
          "  slm-align bundle runs/demo/export/model-Q8_0.gguf --out app/model-bundle --json\n\n"
          "  slm-align bundle runs/demo/export/adapter-dpo-F16.gguf --out app/v2   # base once + each adapter\n\n"
          "  slm-align bundle runs/demo/export/adapter-dpo-F16.gguf --update-from app/v1 --out app/v2-update"
          "   # only the adapters v1 lacks")


def print_bundle(result: dict) -> None:
    """The one-line summary of a bundle written."""
    from slm_align.cli.render import stdout

    what = result["artifact"]
    if "adapters" in result:
        shipped = [entry for entry in result["adapters"] if entry.get("shipped", True)]
        what = f"{result['kind']} bundle of {what} + {len(result['adapters'])} adapter(s), {len(shipped)} shipped"
    stdout.print(f"[bold]bundle[/] -> {result['path']} and {result['zip']}: {what} "
                 f"for {result['runtime']}, model_id {result['model_id']}")


@commands.command(epilog=EPILOG)
def bundle(
    source: str = typer.Argument(..., help="Run directory, or an exported artifact (.gguf, "
                                           "ONNX or genai folder, an adapter export's "
                                           "adapter-STAGE-F16.gguf) or its manifest."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile: picks target and "
                                         "quantization (see `slm-align devices "
                                         "list`); needed for a run."),
    out: Optional[Path] = typer.Option(None, *OUT_NAMES, help="Bundle directory (default "
                                       "bundle-DEVICE beside the artifact); "
                                       "the zip goes beside it."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing bundle."),
    update_from: Optional[Path] = typer.Option(None, "--update-from", help="Adapter exports: the bundle the "
                                               "device has (same base); the update holds only the adapters "
                                               "it lacks."),
    as_json: bool = JsonFlag,
) -> None:
    """One directory and a zip with the artifact, tokenizer, chat template, sampling defaults,
    tool schemas, the export manifest and its verification, and a README naming the runtime
    and the calls to make. An adapter export ships its base once and each adapter as its own file;
    an update ships only new adapters."""
    from slm_align.export.bundle import BundleRequest, make_bundle

    request = BundleRequest(source, device=device, out=out, overwrite=overwrite, update_from=update_from)
    result = make_bundle(request)
    emit(as_json, result, partial(print_bundle, result))
