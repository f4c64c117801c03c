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

EPILOG = ("Examples:\n\n  slm-align bundle runs/demo --device iphone-15-pro   "
          "# exports the profile's Q8_0 first if needed\n\n"
          "  slm-align bundle runs/demo/export/model-Q8_0.gguf --out app/model-bundle --json\n\n"
          "  slm-align bundle runs/demo/export/adapter-dpo-F16.gguf --out app/v2   # base once + each adapter\n\n"
          "  slm-align bundle runs/demo/export/adapter-dpo-F16.gguf --update-from app/v1 --out app/v2-update"
          "   # only the adapters v1 lacks\n\n"
          "  slm-align bundle runs/demo/export/adapter-dpo-F16.gguf --update-from app/v1 --out app/v2-update "
          "--sign keys/bundle-signing-key.pem")
KEYGEN_EPILOG = ("Examples:\n\n  slm-align bundle-keygen --out keys   # keys/bundle-signing-key.pem (private, 0600) "
                 "and keys/bundle-signing-key.pub.pem\n\n  slm-align bundle-keygen --out keys --json")


def print_bundle(result: dict) -> None:
    """The one-line summary of a bundle written."""
    from slm_align.cli.render import stdout

    what = result["artifact"]
    if "adapters" in result:
        shipped = [entry for entry in result["adapters"] if entry.get("shipped", True)]
        what = f"{result['kind']} bundle of {what} + {len(result['adapters'])} adapter(s), {len(shipped)} shipped"
    signed = f", signed by key {result['signed_by'][:12]}" if "signed_by" in result else ""
    stdout.print(f"[bold]bundle[/] -> {result['path']} and {result['zip']}: {what} "
                 f"for {result['runtime']}, model_id {result['model_id']}{signed}")


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
    sign: Optional[Path] = typer.Option(None, "--sign", help="Ed25519 private key (PEM, from `slm-align "
                                        "bundle-keygen`): writes bundle.json.sig, a signature over "
                                        "bundle.json and so every file's sha256."),
    as_json: bool = JsonFlag,
) -> None:
    """One directory and a zip with the artifact, tokenizer, chat template, sampling defaults,
    tool schemas, the export manifest and its verification, and a README naming the runtime
    and the calls to make. An adapter export ships its base once and each adapter as its own file;
    an update ships only new adapters."""
    from slm_align.export.packaging.bundle import BundleRequest, make_bundle

    request = BundleRequest(source, device=device, out=out, overwrite=overwrite, update_from=update_from,
                            sign=sign)
    result = make_bundle(request)
    emit(as_json, result, partial(print_bundle, result))


def print_keys(result: dict) -> None:
    """The one-line summary of a key pair written."""
    from slm_align.cli.render import stdout

    stdout.print(f"[bold]bundle-keygen[/] -> {result['private_key']} (private: keep it, sign with it) and "
                 f"{result['public_key']} (give it to devices), key id {result['key_id'][:12]}")


@commands.command("bundle-keygen", epilog=KEYGEN_EPILOG)
def bundle_keygen(
    out: Path = typer.Option(..., *OUT_NAMES, help="Folder for the key pair (made if missing); an existing "
                                                   "key is never overwritten."),
    as_json: bool = JsonFlag,
) -> None:
    """A new Ed25519 key pair for signing bundles: the private key (PEM, readable by you only) for
    `slm-align bundle --sign`, the public key for the devices that apply updates
    (`apply_update(..., trusted_keys=[...])`)."""
    from slm_align.export.packaging.bundle_signing import generate_keys, key_id, load_public_key

    private, public = generate_keys(out)
    result = {"private_key": str(private), "public_key": str(public), "key_id": key_id(load_public_key(public))}
    emit(as_json, result, partial(print_keys, result))
