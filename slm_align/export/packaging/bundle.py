"""``slm-align bundle``: one directory (and a zip of it) an app developer drops into a phone app.

A bundle holds the exported artifact under ``model/``, the tokenizer, the chat template, the
sampling defaults, the tool schemas, the export manifest with its verification figures,
``bundle.json`` (what is where, the artifact digest the app records as ``model_id`` in the
preference store, every file's sha256) and a README naming the runtime and the calls to make.
``--device NAME`` picks target and quantization from the device profile; a run without the artifact
the device wants is exported first (one it has, made from the same inputs, is reused). An adapter
export (``--target gguf-adapter``) is bundled as its base once plus each adapter file, or, with
``--update-from``, as an update holding only the new adapters
(:mod:`slm_align.export.packaging.adapter_bundle`). ``--sign KEY.pem`` adds ``bundle.json.sig``, an
Ed25519 signature over bundle.json (:mod:`slm_align.export.packaging.bundle_signing`).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from slm_align.atomic import atomic_path
from slm_align.errors import UserError
from slm_align.export.packaging.adapter_bundle import adapter_filler, is_adapter_export
from slm_align.export.packaging.bundle_files import (
    chat_template_of,
    tokenizer_file,
    write_app_files,
    write_json,
)
from slm_align.export.packaging.bundle_readme import RUNTIMES, bundle_readme
from slm_align.export.packaging.bundle_signing import load_private_key, sign_bundle
from slm_align.export.publishing.adapter_export import run_source
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.export.targets import target_named
from slm_align.runs import MANIFEST, Artifact, artifact_manifest, file_checksums, publish_artifact

BUNDLE_FORMAT = 1
"""bundle.json's format of a one-artifact bundle; base + adapters bundles are format 2
(:data:`~slm_align.export.packaging.adapter_bundle.ADAPTER_BUNDLE_FORMAT`)."""
MODEL_DIR = "model"


@dataclass
class BundleRequest:
    """What to bundle; one field per ``slm-align bundle`` option."""

    source: str
    """A run directory, or an exported artifact (.gguf file, ONNX or genai
    folder) with its manifest."""
    device: Optional[str] = None
    """Device profile: picks target and quantization (needed for a run)."""
    out: Optional[Path] = None
    """Bundle directory (default: bundle-DEVICE, else bundle-ARTIFACT, beside the artifact)."""
    overwrite: bool = False
    """Replace an existing bundle."""
    update_from: Optional[Path] = None
    """An adapter export only: the bundle the device has; the update ships only the adapters it
    lacks."""
    sign: Optional[Path] = None
    """An Ed25519 private key (PEM): bundle.json.sig, its signature over bundle.json, goes in the
    bundle."""


def device_choice(device: str) -> tuple[str, str]:
    """(target, quantization) the device profile recommends."""
    from slm_align.ondevice.devices import load_profile
    from slm_align.ondevice.devices.estimate import preferred_quant

    profile = load_profile(device)
    return profile.runtime, preferred_quant(profile)


def _run_artifact(run: Path, device: Optional[str]) -> Path:
    """The run's export for the device, exported (parity-checked) when it is not there yet. A run
    trained from a GGUF ships to a llama.cpp device as that file + the run's adapters (the base
    keeps the quantization it was made with; the merged model re-quantized to Q4_K_M agreed 0.835
    with its PyTorch self on the real Gemma 3 270M, the file + adapter 0.986: docs/shipping.md)."""
    if device is None:
        raise UserError(f"{run} is a run: pass --device NAME to pick the artifact (see `slm-align "
                        "devices list`), or pass an exported artifact")
    target, quant = device_choice(device)
    shipped_as = target_named(target).gguf_run_target
    if shipped_as is not None and run_source(run).kind == "gguf":
        target, quant = shipped_as, "F16"
    result = run_export(ExportRequest(str(run), target=target, quant=quant, device=device,
                                      overwrite=True),
                        reuse=True)  # made from other inputs (a stage trained again): exported anew
    return _manifest_artifact(Path(result.stage_dir))


def _export_manifest(artifact: Path) -> dict:
    manifest = artifact_manifest(artifact)
    if not manifest.is_file():
        raise UserError(f"{artifact} has no export manifest ({manifest.name}); bundle what "
                        f"`slm-align export` wrote")
    try:
        return json.loads(manifest.read_text(encoding="utf-8"))
    except ValueError:
        raise UserError(f"{manifest} is corrupt; export the model again") from None


def locate_artifact(request: BundleRequest) -> Path:
    """The artifact to bundle: the one given, or the run's export for the device."""
    path = Path(request.source).expanduser()
    if not path.exists():
        raise UserError(f"{path} not found; pass a run directory or an exported artifact")
    if path.is_dir() and (path / "sft" / MANIFEST).is_file():
        return _run_artifact(path, request.device)
    return _manifest_artifact(path)


def _manifest_artifact(path: Path) -> Path:
    """The artifact an export manifest given in its place describes (``path`` itself otherwise)."""
    if path.is_file() and path.name == MANIFEST:
        return path.parent
    described = path.with_name(path.name.removesuffix(".json"))
    if path.is_file() and path.suffix == ".json" and described.exists() and artifact_manifest(described) == path:
        return described
    return path


def _copy_artifact(artifact: Path, bundle: Path) -> Path:
    copied = bundle / MODEL_DIR / artifact.name
    copied.parent.mkdir(parents=True)
    if artifact.is_dir():
        shutil.copytree(artifact, copied)
    else:
        shutil.copy2(artifact, copied)
    return copied


def _describe(artifact: Path, manifest: dict, device: Optional[str], template: Optional[str],
              tokenizer: Optional[Path]) -> dict:
    metrics = manifest.get("metrics", {})
    target = metrics.get("target", "gguf")
    return {"format": BUNDLE_FORMAT, "runtime": RUNTIMES[target]["name"], "target": target,
            "quant": metrics.get("quant"), "device": device,
            "artifact": f"{MODEL_DIR}/{artifact.name}", "model_id": metrics.get("sha256"),
            "verification_passed": metrics.get("verification", {}).get("passed"),
            "chat_template": "chat_template.jinja" if template is not None else None,
            "tokenizer": "tokenizer.json" if tokenizer is not None else "embedded in the artifact"}


def _fill(bundle: Path, artifact: Path, manifest: dict, device: Optional[str]) -> dict:
    """Write every file of the bundle into ``bundle``; returns bundle.json's content."""
    _copy_artifact(artifact, bundle)
    template = chat_template_of(artifact)
    tokenizer = tokenizer_file(artifact, manifest)
    write_app_files(bundle, template, tokenizer)
    write_json(bundle / "export-manifest.json", manifest)
    write_json(bundle / "verification.json", manifest.get("metrics", {}).get("verification", {}))
    described = _describe(artifact, manifest, device, template, tokenizer)
    (bundle / "README.md").write_text(bundle_readme(described), encoding="utf-8")
    described["files"] = file_checksums(bundle)
    write_json(bundle / "bundle.json", described)
    return described


def _zip(folder: Path, target: Path) -> None:
    """``folder`` zipped with its name as the top directory, written atomically."""
    with atomic_path(target) as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                archive.write(file, (Path(folder.name) / file.relative_to(folder)).as_posix())


def _default_out(artifact: Path, device: Optional[str], update: bool) -> Path:
    """bundle-DEVICE, else bundle-ARTIFACT, beside the artifact (with ``-update`` for an update)."""
    name = device or artifact.name.removesuffix(".gguf")
    return artifact.parent / f"bundle-{name}{'-update' if update else ''}"


def _filler(artifact: Path, manifest: dict, request: BundleRequest) -> Callable[[Path], dict]:
    """What writes this export's bundle into a folder (an adapter export's: base + adapters, or an
    update)."""
    if is_adapter_export(manifest):
        return adapter_filler(artifact, manifest, request.device, request.update_from)
    if request.update_from is not None:
        target = manifest.get("metrics", {}).get("target", "gguf")
        raise UserError(f"--update-from ships adapters, and {artifact} is a {target} export: "
                        "bundle an adapter export (`slm-align export RUN --target gguf-adapter`), "
                        "or drop --update-from")
    return partial(_fill, artifact=artifact, manifest=manifest, device=request.device)


class Bundle(Artifact):
    """The bundle folder ``final`` that ``fill`` writes (signed with ``key`` when given); its zip is
    made beside it once it is published."""

    def __init__(self, out: Path, fill: Callable[[Path], dict], key):
        self.final, self.fill, self.key = out, fill, key
        self.archive = out.with_name(out.name + ".zip")

    def taken(self) -> bool:
        return self.final.exists() or self.archive.exists()

    def build(self, scratch: Path) -> Path:
        self.described = self.fill(scratch)
        self.signed = {} if self.key is None else {"signed_by": sign_bundle(scratch, self.key)}
        return scratch


def make_bundle(request: BundleRequest) -> dict:
    """Write the bundle directory and its zip; returns bundle.json's content
    with ``path`` and ``zip``."""
    if request.device is not None:
        device_choice(request.device)  # an unknown profile: refused before any work
    # a bad key: before any work
    key = load_private_key(request.sign) if request.sign is not None else None
    artifact = locate_artifact(request)
    manifest = _export_manifest(artifact)
    fill = _filler(artifact, manifest, request)
    update = request.update_from is not None
    out = Path(request.out) if request.out is not None else _default_out(artifact, request.device, update)
    bundle = Bundle(out, fill, key)
    publish_artifact(bundle, overwrite=request.overwrite, manifest=False)
    _zip(out, bundle.archive)
    return dict(bundle.described, path=str(out), zip=str(bundle.archive), **bundle.signed)
