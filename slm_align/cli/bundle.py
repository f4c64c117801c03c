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


def print_bundle(result: dict) -> None:
    from slm_align.cli.render import stdout

    stdout.print(f"[bold]bundle[/] -> {result['path']} and {result['zip']}: {result['artifact']} "
                 f"for {result['runtime']}, model_id {result['model_id']}")


@commands.command(epilog="Examples:\n\n  slm-align bundle runs/demo --device iphone-15-pro   # "
                         "exports Q4_K_M first if needed\n\n  slm-align bundle "
                         "runs/demo/export/model-Q8_0.gguf --out app/model-bundle --json")
def bundle(
    source: str = typer.Argument(..., help="Run directory, or an exported artifact (.gguf, "
                                           "ONNX or genai folder)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile: picks target and "
                                         "quantization (see `slm-align devices "
                                         "list`); needed for a run."),
    out: Optional[Path] = typer.Option(None, *OUT_NAMES, help="Bundle directory (default "
                                       "bundle-DEVICE beside the artifact); "
                                       "the zip goes beside it."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing bundle."),
    as_json: bool = JsonFlag,
) -> None:
    """One directory and a zip with the artifact, tokenizer, chat template, sampling defaults,
    tool schemas, the export manifest and its verification, and a README naming the runtime
    and the calls to make."""
    from slm_align.export.bundle import BundleRequest, make_bundle

    result = make_bundle(BundleRequest(source, device=device, out=out, overwrite=overwrite))
    emit(as_json, result, partial(print_bundle, result))
