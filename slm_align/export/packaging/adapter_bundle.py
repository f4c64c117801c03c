"""Bundles of an adapter export (``slm-align export RUN --target gguf-adapter``).

A full bundle holds the base once under ``model/`` and each LoRA adapter as its own file under
``adapters/``; bundle.json lists them in load order with their sha256 and scale, and ``model_id`` is
the chain's id (:func:`~slm_align.ondevice.gguf.adapter_check.chain_digest`). An update bundle
(``--update-from OLD``) is for a device that has OLD installed: no base, only the adapters whose
sha256 OLD does not list, the whole chain in bundle.json (each entry ``shipped`` or not),
``requires_base_sha256`` and ``replaces_model_id``. :func:`apply_update` turns an installed bundle
and an update into the full bundle of the new chain, once a trusted key's signature
(:mod:`~slm_align.export.packaging.bundle_signing`) and the update's paths, files and chain ids
(:mod:`~slm_align.export.packaging.update_checks`) hold.

These bundles are format 2: their ``artifact`` (kept, for old readers, at the base) is not the whole
model, so a format-1 reader that loaded it alone would answer as the base under the chain's
model_id.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import gguf

from slm_align.atomic import publish_directory
from slm_align.errors import UserError
from slm_align.export.packaging.bundle_files import (
    chat_template_of,
    tokenizer_file,
    write_app_files,
    write_json,
)
from slm_align.export.packaging.bundle_readme import adapter_bundle_readme, update_bundle_readme
from slm_align.export.packaging.bundle_signing import SIGNATURE, TrustedKey, check_signature
from slm_align.export.packaging.update_checks import (
    ADAPTERS_DIR,
    BUNDLE_JSON,
    INSTALLED_ROLE,
    MODEL_DIR,
    RECORDS,
    UPDATE_ROLE,
    check_bundle_fields,
    check_claims,
    check_update_files,
    plain_name,
)
from slm_align.export.publishing.adapter_export import TARGET, manifest_files
from slm_align.ondevice.gguf.fields import read_fields
from slm_align.runs import Artifact, file_checksums, publish_artifact, sha256_file

ADAPTER_BUNDLE_FORMAT = 2
EXPORT_RECORDS = RECORDS
"""What an update replaces in the installed bundle besides bundle.json and the README."""
UPDATE_KEYS = ("kind", "requires_base_sha256", "replaces_model_id")


def is_adapter_export(manifest: dict) -> bool:
    """Whether an export manifest is an adapter export's (base + adapters)."""
    return manifest.get("metrics", {}).get("target") == TARGET


def _checked_file(path: Path, sha256: str, what: str) -> Path:
    """``path``, refused in one line when it is gone or no longer has the ``sha256`` the export
    recorded."""
    if not path.is_file():
        raise UserError(f"{what} {path} not found; export the run again (`slm-align export RUN "
                        f"--target {TARGET}`)")
    found = sha256_file(path)
    if found != sha256:
        raise UserError(f"{what} {path} has sha256 {found[:12]}, the export recorded "
                        f"{sha256[:12]}: it changed after export; export the run again")
    return path


def export_files(artifact: Path, manifest: dict) -> tuple[Path, list[Path]]:
    """(base, adapters in order) of the adapter export whose manifest is beside ``artifact``, each
    checked against the sha256 the manifest records."""
    base, adapters = manifest_files(manifest, artifact.parent)
    metrics = manifest["metrics"]
    _checked_file(base, metrics["base"]["sha256"], "the base")
    for path, entry in zip(adapters, metrics["adapters"]):
        _checked_file(path, entry["sha256"], "the adapter")
    return base, adapters


def _entries(manifest: dict) -> list[dict]:
    """bundle.json's adapters: path in the bundle, stage, sha256 and scale, in load order."""
    return [{"path": f"{ADAPTERS_DIR}/{entry['path']}", "stage": entry["stage"], "sha256": entry["sha256"],
             "scale": entry["scale"]} for entry in manifest["metrics"]["adapters"]]


def base_file_type(base: Path) -> Optional[str]:
    """The weight type of a GGUF base as llama.cpp names it, read from its header's
    ``general.file_type`` (3 -> ``Q4_1``, 7 -> ``Q8_0``): what the base is, whatever type the
    adapters were exported in. None when the file does not say or says a number gguf-py does not
    know."""
    field = read_fields(base, prefix="general.file_type").get("general.file_type")
    if field is None:
        return None
    try:
        name = gguf.LlamaFileType(int(field.value)).name
    except ValueError:
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def describe_full(manifest: dict, base_name: str, device: Optional[str], template: Optional[str],
                  tokenizer: Optional[Path], base_quant: Optional[str] = None) -> dict:
    """bundle.json's fields (all but ``files``) of a full bundle of the adapter export ``manifest``;
    ``base_quant``: the base's own weight type (:func:`base_file_type`), apart from ``quant``, the
    export's."""
    metrics = manifest["metrics"]
    base = f"{MODEL_DIR}/{base_name}"
    return {"format": ADAPTER_BUNDLE_FORMAT, "kind": "full", "runtime": "llama.cpp",
            "target": TARGET, "quant": metrics.get("quant"), "base_quant": base_quant,
            "device": device, "artifact": base, "base": base,
            "base_sha256": metrics["base"]["sha256"], "adapters": _entries(manifest),
            "model_id": metrics["sha256"],
            "verification_passed": metrics.get("verification", {}).get("passed"),
            "chat_template": "chat_template.jinja" if template is not None else None,
            "tokenizer": "tokenizer.json" if tokenizer is not None else "embedded in the base"}


def _finish(bundle: Path, described: dict, readme: Callable[[dict], str]) -> dict:
    """Write the README and bundle.json (with every file's sha256); returns bundle.json's
    content."""
    (bundle / "README.md").write_text(readme(described), encoding="utf-8")
    described["files"] = file_checksums(bundle)
    write_json(bundle / BUNDLE_JSON, described)
    return described


def _write_records(bundle: Path, manifest: dict) -> None:
    """The export manifest and its verification, as every bundle carries them."""
    write_json(bundle / "export-manifest.json", manifest)
    write_json(bundle / "verification.json", manifest.get("metrics", {}).get("verification", {}))


def fill_full(bundle: Path, artifact: Path, manifest: dict, device: Optional[str]) -> dict:
    """Write a full bundle of the adapter export into ``bundle``: the base once, each adapter, the
    tokenizer, template, sampling defaults, tool schemas and records; returns bundle.json's
    content."""
    base, adapters = export_files(artifact, manifest)
    (bundle / MODEL_DIR).mkdir()
    shutil.copy2(base, bundle / MODEL_DIR / base.name)
    (bundle / ADAPTERS_DIR).mkdir()
    for adapter in adapters:
        shutil.copy2(adapter, bundle / ADAPTERS_DIR / adapter.name)
    template = chat_template_of(base)
    tokenizer = tokenizer_file(artifact, manifest)
    write_app_files(bundle, template, tokenizer)
    _write_records(bundle, manifest)
    described = describe_full(manifest, base.name, device, template, tokenizer,
                              base_file_type(base))
    return _finish(bundle, described, adapter_bundle_readme)


def read_bundle(folder: Path, role: str) -> dict:
    """bundle.json of a base + adapters bundle (full or update) at ``folder``; one line, naming
    ``role`` (the flag or argument), for a folder that is not one."""
    folder = Path(folder).expanduser()
    described_path = folder / BUNDLE_JSON
    if described_path.is_symlink():
        raise UserError(f"{role} {folder}'s {BUNDLE_JSON} is a "
                        "symlink; a bundle holds plain files only")
    if not described_path.is_file():
        raise UserError(f"{role} {folder} is not a bundle (no {BUNDLE_JSON}); pass a directory "
                        "`slm-align bundle` wrote")
    try:
        described = json.loads(described_path.read_text(encoding="utf-8"))
    except ValueError:
        raise UserError(f"{described_path} is corrupt; bundle the export again") from None
    if not isinstance(described, dict) or not described.get("base_sha256") or not described.get("base") or \
            not isinstance(described.get("adapters"), list):
        artifact = described.get("artifact") if isinstance(described, dict) else None
        raise UserError(f"{role} {folder} is a bundle of {artifact}, not of base + adapters; "
                        f"bundle an adapter export (`slm-align export RUN --target {TARGET}`) in "
                        "full first")
    return described


def describe_update(manifest: dict, old: dict, device: Optional[str]) -> dict:
    """bundle.json's fields (all but ``files``) of the update that takes a device with the bundle
    ``old`` to the adapter export ``manifest``; refuses another base, or the chain ``old`` already
    is."""
    metrics = manifest["metrics"]
    if metrics["base"]["sha256"] != old["base_sha256"]:
        raise UserError(f"the export's base has sha256 {metrics['base']['sha256'][:12]}, the "
                        f"--update-from bundle's {old['base_sha256'][:12]}: an update keeps the "
                        "device's base; drop --update-from to make a full bundle")
    if metrics["sha256"] == old.get("model_id"):
        raise UserError(f"already shipped: the --update-from bundle is this chain (model_id "
                        f"{metrics['sha256'][:12]}); nothing new to ship")
    installed = {entry.get("sha256") for entry in old["adapters"]}
    adapters = [dict(entry, shipped=entry["sha256"] not in installed)
                for entry in _entries(manifest)]
    template = old.get("chat_template")
    tokenizer = Path(old["tokenizer"]) if old.get("tokenizer") == "tokenizer.json" else None
    described = describe_full(manifest, old["base"].split("/", 1)[1], device, template, tokenizer,
                              old.get("base_quant"))
    return dict(described, kind="update", adapters=adapters,
                requires_base_sha256=old["base_sha256"], replaces_model_id=old.get("model_id"))


def fill_update(bundle: Path, artifact: Path, manifest: dict, described: dict) -> dict:
    """Write into ``bundle`` the update ``described`` (:func:`describe_update`): the adapters it
    ships, the export's records, README and bundle.json; returns bundle.json's content."""
    _, adapters = export_files(artifact, manifest)
    (bundle / ADAPTERS_DIR).mkdir()
    for path, entry in zip(adapters, described["adapters"]):
        if entry["shipped"]:
            shutil.copy2(path, bundle / entry["path"])
    _write_records(bundle, manifest)
    return _finish(bundle, described, update_bundle_readme)


def adapter_filler(artifact: Path, manifest: dict, device: Optional[str],
                   update_from: Optional[Path]) -> Callable[[Path], dict]:
    """What writes the bundle of an adapter export into a folder: a full bundle, or
    (``update_from``) the update for a device that has that bundle, refused here, before anything is
    written."""
    if update_from is None:
        return partial(fill_full, artifact=artifact, manifest=manifest, device=device)
    old = read_bundle(update_from, "--update-from")
    check_bundle_fields(old, "--update-from", update=False)
    described = describe_update(manifest, old, device)  # refusals first
    return partial(fill_update, artifact=artifact, manifest=manifest, described=described)


def copy_verified(source: Path, target: Path, sha256: str, what: str) -> None:
    """Copy ``source`` to the new file ``target``, hashing the bytes as they are written: what is
    published is what was checked. Refuses (one line) a source that is missing, a symlink or not a
    regular file, an existing target (``x`` mode: never through a link), and bytes whose sha256 is
    not ``sha256``."""
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise UserError(f"{what} {source} not found; install the full bundle instead") from None
    except OSError:  # ELOOP: the last component is a symlink
        raise UserError(f"{what} {source} is a symlink; a bundle "
                        "holds plain files only: refusing it") from None
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(reader.fileno()).st_mode):
            raise UserError(f"{what} {source} is not a regular file; refusing it")
        with open(target, "xb") as writer:
            for block in iter(partial(reader.read, 1 << 20), b""):
                digest.update(block)
                writer.write(block)
    if digest.hexdigest() != sha256:
        raise UserError(f"{what} {source} has sha256 {digest.hexdigest()[:12]}, bundle.json "
                        f"records {sha256[:12]}: it changed after bundling; refusing the update")


def _inside(folder: Path, name: str) -> Path:
    """``folder``/``name``, refused unless it resolves to a file directly inside ``folder``."""
    target = folder / name
    if target.resolve().parent != folder.resolve():
        raise UserError(f"the adapter name {name[:120]!r} leaves "
                        "the bundle folder; refusing the update")
    return target


def _installed_adapter(installed: Path, old: dict, sha256: str) -> Path:
    """The installed bundle's adapter file with ``sha256``; one line when it has none."""
    for entry in old["adapters"]:
        if entry["sha256"] == sha256:
            return installed / entry["path"]
    raise UserError(f"the installed bundle {installed} has no adapter of sha256 {sha256[:12]} that "
                    "the update needs; install the full bundle instead")


def _applied(installed: Path, old: dict, update: Path, new: dict, scratch: Path) -> dict:
    """Fill ``scratch`` with the installed bundle's files, the update's adapters and records, each
    checked as it is copied; returns the full bundle's bundle.json."""
    kept = (ADAPTERS_DIR, BUNDLE_JSON, SIGNATURE, "README.md", *EXPORT_RECORDS)
    shutil.copytree(installed, scratch, ignore=partial(_ignored, installed, kept),
                    dirs_exist_ok=True)
    base = scratch / old["base"]
    if not base.is_file() or sha256_file(base) != new["requires_base_sha256"]:
        raise UserError(f"the installed base {installed / old['base']} is missing or changed (not "
                        f"sha256 {new['requires_base_sha256'][:12]}); install the full bundle "
                        "instead")
    (scratch / ADAPTERS_DIR).mkdir()
    entries = []
    for entry in new["adapters"]:
        source = update / entry["path"] if entry["shipped"] else _installed_adapter(installed, old, entry["sha256"])
        target = _inside(scratch / ADAPTERS_DIR,
                         plain_name(entry["path"], ADAPTERS_DIR, UPDATE_ROLE))
        copy_verified(source, target, entry["sha256"], "the adapter")
        entries.append({key: value for key, value in entry.items() if key != "shipped"})
    for name in EXPORT_RECORDS:
        copy_verified(update / name, scratch / name, new["files"][name], f"the update's {name}")
    described = {key: value for key, value in new.items() if key not in (*UPDATE_KEYS, "files")}
    return _finish(scratch, dict(described, kind="full", adapters=entries), adapter_bundle_readme)


def _ignored(root: Path, names: tuple, folder: str, contents: list[str]) -> list[str]:
    """copytree's ignore: ``names`` at the top of ``root`` only."""
    return [name for name in contents if Path(folder) == root and name in names]


def _checked_update(installed: Path, update: Path, trusted_keys: Sequence[TrustedKey],
                    allow_unsigned: bool) -> tuple[dict, dict]:
    """(installed, update) bundle.json contents, once the update is signed by a trusted key (unless
    ``allow_unsigned``), well formed, holds adapters only and names the chains it replaces and
    makes."""
    if not trusted_keys and not allow_unsigned:
        raise UserError("no trusted key to check the update against: pass "
                        "trusted_keys=[PUBLIC_KEY.pem] (the publisher's `slm-align bundle-keygen` "
                        "public key), or allow_unsigned=True to trust its hashes alone")
    old = read_bundle(installed, INSTALLED_ROLE)
    new = read_bundle(update, UPDATE_ROLE)
    if new.get("kind") != "update":
        raise UserError(f"{update} is a {new.get('kind')} bundle, "
                        "not an update; install it as it is")
    if trusted_keys:
        check_signature(update, new, trusted_keys, UPDATE_ROLE)
    check_bundle_fields(old, INSTALLED_ROLE, update=False)
    check_bundle_fields(new, UPDATE_ROLE, update=True)
    check_claims(old, new, UPDATE_ROLE)
    check_update_files(update, new, UPDATE_ROLE)
    return old, new


class AppliedUpdate(Artifact):
    """The full bundle an update makes of the installed one, at ``final`` (never replaced)."""

    exists_advice = "choose another folder for the updated bundle"

    def __init__(self, installed: Path, update: Path, out: Path, old: dict, new: dict):
        self.installed, self.update, self.final, self.old, self.new = installed, update, out, old, new

    def build(self, scratch: Path) -> Path:
        self.described = _applied(self.installed, self.old, self.update, self.new, scratch)
        return scratch

    def place(self, built: Path, manifest: Optional[dict]) -> None:
        """Renamed into place unless ``final`` was made meanwhile by another writer (left as it
        is)."""
        try:
            publish_directory(built, self.final)
        except OSError:
            if self.final.exists():
                raise UserError(f"{self.final} exists; {self.exists_advice}") from None
            raise


def apply_update(installed: Path, update: Path, out: Path, trusted_keys: Sequence[TrustedKey] = (),
                 allow_unsigned: bool = False) -> dict:
    """Write at ``out`` the full bundle that the update bundle ``update`` makes of the ``installed``
    one (its base, the adapters the update did not ship, the update's adapters). Returns
    bundle.json.

    The update must be signed (``bundle.json.sig``) by one of ``trusted_keys`` (public keys: PEM
    paths, PEM bytes or key objects); ``allow_unsigned=True`` with no keys trusts its hashes alone,
    which proves integrity, not origin. Refused in one line, with nothing written: no trusted key,
    another base or chain, a path that is not a plain name under ``adapters/``, a symlink, a file
    other than adapters and records, a model_id that is not the chain's, a sha256 that does not
    hold, an existing ``out``. The new bundle is assembled in a hidden scratch folder beside ``out``
    and renamed into place (:func:`~slm_align.runs.publish_artifact`)."""
    installed, update, out = Path(installed).expanduser(), Path(update).expanduser(), Path(out).expanduser()
    old, new = _checked_update(installed, update, trusted_keys, allow_unsigned)
    applied = AppliedUpdate(installed, update, out, old, new)
    publish_artifact(applied, manifest=False)
    return applied.described
