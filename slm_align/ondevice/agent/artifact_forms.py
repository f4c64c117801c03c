"""What a user may pass as one artifact to the runtime (``evaluate-agent --artifact``, ``Agent.load``,
``chat``), resolved to the model file (or ONNX folder) and the LoRA adapters applied to it, in order:

- a model: a ``.gguf`` file or an ONNX export directory;
- base + adapters: ``BASE.gguf+ADAPTER1.gguf+ADAPTER2.gguf`` (``+`` joins paths; a path that exists as
  written is taken whole, so a file name holding ``+`` still opens);
- an adapter export's manifest: ``RUN/export/adapter-<STAGE>-<TYPE>.gguf.json``, written by
  ``slm-align export RUN --target gguf-adapter`` (its base and adapters, each checked against the
  sha256 it records);
- a bundle folder (``slm-align bundle``): a base + adapters bundle (format 2, ``kind`` full) or a
  one-artifact bundle (its ``artifact``).

An adapter GGUF passed alone (``general.type`` = ``adapter`` in its header, read torch-free by
:mod:`slm_align.ondevice.gguf.fields`) is not a model: it is refused in one line naming the forms that open
it, never mistaken for a damaged file. The manifest and bundle readers are written here rather than
imported from ``slm_align.export`` because the runtime (the device wing) may not import a stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional, Union

from slm_align.errors import UserError
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.gguf.fields import read_fields
from slm_align.runs import sha256_file

ADAPTER_TARGET = "gguf-adapter"
BUNDLE_JSON = "bundle.json"
FORMS = ("a .gguf file, an ONNX export directory, BASE.gguf+ADAPTER.gguf, an adapter export's "
         "manifest (RUN/export/adapter-*.gguf.json) or a bundle folder")


@dataclass(frozen=True)
class ArtifactForm:
    """An artifact as the runtime opens it: the model and the adapters applied to it, in order."""

    model: Path
    adapters: tuple[Path, ...] = ()
    model_id: Optional[str] = None
    """The chain id a manifest or bundle records (None: nothing recorded to check against)."""


def gguf_type(path: Path) -> Optional[str]:
    """The ``general.type`` a .gguf's header records (``adapter``; ``model`` when it records none, GGUF's
    default); None for a file that is no readable GGUF (llama.cpp then refuses it in its own words)."""
    try:
        field = read_fields(Path(path), prefix="general.type").get("general.type")
    except (UserError, OSError):
        return None
    return "model" if field is None else field.value


def is_adapter_gguf(path: Path) -> bool:
    """Whether the .gguf at ``path`` says in its header that it is an adapter (``general.type``)."""
    return gguf_type(path) == "adapter"


def refuse_adapter_alone(path: Path) -> None:
    """One line for a LoRA adapter GGUF passed where a model is expected, naming how to open it."""
    path = Path(path)
    if not is_adapter_gguf(path):
        return
    manifest = path.with_name(path.name + ".json")
    fix = f"pass its export's manifest ({manifest}) or " if manifest.is_file() else "pass "
    raise UserError(f"{path} is a LoRA adapter, not a model: {fix}the base with it "
                    f"(BASE.gguf+{path.name}) or the bundle it ships in")


def resolve_artifact(spec: Union[str, Path]) -> ArtifactForm:
    """The model and adapters ``spec`` names (see the module docstring); one line for a path that is
    missing or a file that is none of these forms."""
    path = Path(spec)
    text = str(spec)
    if "+" in text and not path.exists():
        return _joined(text)
    if not path.exists():
        return ArtifactForm(path)  # the backend's own refusal names what it opens
    if path.is_dir() and (path / BUNDLE_JSON).is_file():
        return _bundle(path)
    if path.is_file() and path.suffix.lower() == ".json":
        return _manifest(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        refuse_adapter_alone(path)
    return ArtifactForm(path)


def _joined(text: str) -> ArtifactForm:
    """``BASE.gguf+ADAPTER.gguf[+...]``: each part an existing .gguf, the adapters adapters."""
    parts = [Path(part) for part in text.split("+")]
    for part in parts:
        if not part.is_file() or part.suffix.lower() != ".gguf":
            raise UserError(f"artifact {text}: {part} is not a .gguf file; join a base GGUF and its "
                            "adapter GGUFs with '+', e.g. base-F16.gguf+adapter-sft-F16.gguf")
    refuse_adapter_alone(parts[0])
    for adapter in parts[1:]:
        if gguf_type(adapter) not in ("adapter", None):
            raise UserError(f"artifact {text}: {adapter} is a model, not a LoRA adapter; only the "
                            "first path is the base, those after '+' are its adapters")
    return ArtifactForm(parts[0], tuple(parts[1:]))


def _read_json(path: Path, what: str) -> dict:
    """The JSON object at ``path``; one line when it is not one."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        found = None
    if not isinstance(found, dict):
        raise UserError(f"{path} is not {what} (not a JSON object); pass {FORMS}")
    return found


def _checked(path: Path, sha256: object, where: Path) -> Path:
    """``path``, refused in one line when missing or not the bytes ``where`` records."""
    if not path.is_file():
        raise UserError(f"{path}, named by {where}, not found; export or bundle it again")
    if isinstance(sha256, str) and sha256_file(path) != sha256:
        raise UserError(f"{path} does not match the sha256 {where} records: it changed after export; "
                        "export or bundle it again")
    return path


def _manifest(path: Path) -> ArtifactForm:
    """An adapter export's manifest: its base (absolute, or beside it) and adapters, checked."""
    metrics = _read_json(path, "an export manifest").get("metrics")
    if not isinstance(metrics, dict) or metrics.get("target") != ADAPTER_TARGET:
        raise UserError(f"{path} is not an adapter export's manifest; pass {FORMS}")
    try:
        base = Path(metrics["base"]["path"])
        adapters = [(str(entry["path"]), entry.get("sha256")) for entry in metrics["adapters"]]
    except (KeyError, TypeError):
        raise UserError(f"{path} is corrupt (no base or adapters); export the run again") from None
    base = base if base.is_absolute() else path.parent / base
    _checked(base, metrics["base"].get("sha256"), path)
    files = tuple(_checked(path.parent / PurePosixPath(name).name, sha, path) for name, sha in adapters)
    return ArtifactForm(base, files, metrics.get("sha256"))


def _inside(folder: Path, name: object) -> Path:
    """``folder/name`` for a relative path that stays inside ``folder``; one line otherwise."""
    relative = PurePosixPath(name) if isinstance(name, str) else None
    if relative is None or relative.is_absolute() or ".." in relative.parts:
        raise UserError(f"{folder / BUNDLE_JSON} names the file {str(name)[:120]!r}: only paths inside "
                        "the bundle are allowed; bundle the export again")
    return folder / relative


def _bundle(folder: Path) -> ArtifactForm:
    """A bundle folder: base + adapters (each adapter checked), or its one artifact."""
    described = _read_json(folder / BUNDLE_JSON, "a bundle's bundle.json")
    if described.get("kind") == "update":
        raise UserError(f"{folder} is an update bundle (adapters only, no base): apply it to the installed "
                        "bundle first (`apply_update`), then pass the bundle it makes")
    entries = described.get("adapters")
    if isinstance(entries, list) and described.get("base"):
        base = _checked(_inside(folder, described["base"]), described.get("base_sha256"), folder / BUNDLE_JSON)
        adapters = tuple(_checked(_inside(folder, entry.get("path")), entry.get("sha256"), folder / BUNDLE_JSON)
                         for entry in entries if isinstance(entry, dict))
        if len(adapters) != len(entries):
            raise UserError(f"{folder / BUNDLE_JSON} lists an adapter that is not an object; bundle again")
        return ArtifactForm(base, adapters, described.get("model_id"))
    if described.get("artifact"):
        return ArtifactForm(_inside(folder, described["artifact"]))
    raise UserError(f"{folder} holds a bundle.json that names no model; bundle the export again")


def check_chain_id(form: ArtifactForm, base_sha256: str, backend) -> None:
    """Refuse (one line) a manifest's or bundle's files whose chain id is not the one it records."""
    found = chain_digest(base_sha256, [adapter["sha256"] for adapter in getattr(backend, "adapters", ())])
    if form.model_id and found != form.model_id:
        raise UserError(f"{form.model} with its adapters is model {found[:12]}, its manifest or bundle "
                        f"records {form.model_id[:12]}: a file changed after export; export it again")
