"""What an update bundle may hold and claim, checked before
:func:`~slm_align.export.packaging.adapter_bundle.apply_update` writes anything (issue 45, items 1
and 2).

An update adds adapters: its files are ``adapters/NAME`` (plain names: no ``..``, no folder, not
absolute), its export records and README, each listed in bundle.json's ``files``; nothing else, no
symlink, nothing unlisted. It keeps the installed base, template and tokenizer (bundle.json names
the same ones), applies to the chain the device has (``replaces_model_id`` is the installed chain's
id, recomputed) and names the chain it makes (``model_id`` recomputed from the adapters' sha256s
with :func:`~slm_align.ondevice.gguf.adapter_check.chain_digest`). A malformed bundle.json (a key
missing, a wrong type) is refused in one line like every other case.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path, PurePosixPath

from slm_align.errors import UserError
from slm_align.export.packaging.bundle_signing import SIGNATURE
from slm_align.ondevice.gguf.adapter_check import chain_digest

ADAPTERS_DIR = "adapters"
MODEL_DIR = "model"
BUNDLE_JSON = "bundle.json"
RECORDS = ("export-manifest.json", "verification.json")
UPDATE_EXTRAS = frozenset({"README.md", *RECORDS})
"""What an update ships besides its adapters (each listed in ``files``)."""
KEPT_FIELDS = ("base", "base_sha256", "artifact", "chat_template", "tokenizer")
"""bundle.json fields an update may not change: what the device keeps."""
UPDATE_ROLE = "the update"
INSTALLED_ROLE = "the installed bundle"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REMAKE = "make it again with `slm-align bundle EXPORT --update-from INSTALLED`"


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _refuse(role: str, detail: str) -> UserError:
    fix = _REMAKE if role == UPDATE_ROLE else "bundle the export in full again"
    return UserError(f"{role} is malformed: {detail}; {fix}")


def plain_name(path: object, folder: str, role: str) -> str:
    """The file name of ``path`` when it is exactly ``FOLDER/NAME`` with NAME a plain file name (no
    ``..``, no further folder, no leading dot, no backslash or NUL, not absolute); one line
    otherwise."""
    if not isinstance(path, str):
        raise _refuse(role, f"a path is {type(path).__name__}, not text")
    parts = PurePosixPath(path).parts
    name = parts[-1] if len(parts) == 2 else ""
    if parts[:1] != (folder,) or not name or name.startswith(".") or "\\" in name or "\0" in name \
            or path != f"{folder}/{name}":
        raise UserError(f"{role} names the file {path[:120]!r}: only plain names under {folder}/ "
                        "are allowed (no '..', no folder, not absolute); refusing it")
    return name


def _check_entry(entry: object, role: str, update: bool) -> str:
    """One bundle.json adapter entry's file name; one line when a field is missing or of the wrong
    type."""
    if not isinstance(entry, dict):
        raise _refuse(role, f"an adapter entry is {type(entry).__name__}, not an object")
    if not _is_sha256(entry.get("sha256")):
        raise _refuse(role, f"the adapter entry {str(entry.get('path'))[:80]} "
                            "has no sha256 (64 hex digits)")
    scale = entry.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise _refuse(role, f"the adapter entry {str(entry.get('path'))[:80]} "
                            "has a scale that is not a number")
    if update and not isinstance(entry.get("shipped"), bool):
        raise _refuse(role, f"the adapter entry {str(entry.get('path'))[:80]} "
                            "does not say whether it is shipped")
    return plain_name(entry.get("path"), ADAPTERS_DIR, role)


def check_bundle_fields(described: dict, role: str, update: bool) -> None:
    """bundle.json's fields that applying an update reads, each of the right type; adapter paths
    plain and distinct. ``update``: the update's (``shipped``, ``requires_base_sha256``,
    ``replaces_model_id``, ``files``)."""
    digests = ("base_sha256", "model_id",
               *(("requires_base_sha256", "replaces_model_id") if update else ()))
    for key in digests:
        if not _is_sha256(described.get(key)):
            raise _refuse(role, f"{key} is {str(described.get(key))[:80]!r}, "
                                "not a sha256 (64 hex digits)")
    plain_name(described.get("base"), MODEL_DIR, role)
    adapters = described.get("adapters")
    if not adapters:
        raise _refuse(role, "it lists no adapters")
    names = [_check_entry(entry, role, update) for entry in adapters]
    if len(set(names)) != len(names):
        raise _refuse(role, "it names one adapter file twice")
    files = described.get("files")
    if not isinstance(files, dict) or not all(isinstance(name, str) and _is_sha256(digest)
                                              for name, digest in files.items()):
        raise _refuse(role, "files is not a map of file names to sha256s")


def check_claims(old: dict, new: dict, role: str) -> None:
    """The update keeps what the device has (base, template, tokenizer), replaces the installed
    chain and makes the chain it names: both chain ids recomputed, never taken as written."""
    for key in KEPT_FIELDS:
        if new.get(key) != old.get(key):
            raise UserError(f"{role} changes {key} ({str(old.get(key))[:40]} -> "
                            f"{str(new.get(key))[:40]}): an update adds adapters only; install a "
                            "full bundle to change the base, template or tokenizer")
    if new["requires_base_sha256"] != old["base_sha256"]:
        raise UserError(f"{role} needs base sha256 {new['requires_base_sha256'][:12]}, the "
                        f"installed bundle has {old['base_sha256'][:12]}; install the full bundle "
                        "instead")
    installed_id = chain_digest(old["base_sha256"], [entry["sha256"] for entry in old["adapters"]])
    if installed_id != old["model_id"]:
        raise UserError(f"the installed bundle's model_id {old['model_id'][:12]} is not the id of "
                        f"its chain ({installed_id[:12]}); reinstall its full bundle")
    if new["replaces_model_id"] != installed_id:
        raise UserError(f"{role} replaces model_id {new['replaces_model_id'][:12]}, the installed "
                        f"chain is {installed_id[:12]}; apply the updates in order, or install the "
                        "full bundle")
    made = chain_digest(new["base_sha256"], [entry["sha256"] for entry in new["adapters"]])
    if made != new["model_id"]:
        raise UserError(f"{role} claims model_id {new['model_id'][:12]}, its adapters make "
                        f"{made[:12]}; refusing it")


def _found_files(folder: Path, role: str) -> set[str]:
    """Every file below ``folder`` (relative, POSIX); one line for a symlink or anything but a
    regular file."""
    found = set()
    for root, folders, files in os.walk(folder):  # does not follow symlinked folders: refused below
        for name in (*folders, *files):
            path = Path(root) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) or (name in files and not stat.S_ISREG(mode)):
                kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
                raise UserError(f"{role}'s {path.relative_to(folder).as_posix()} is {kind}; an "
                                "update holds plain files only: refusing it")
            if name in files:
                found.add(path.relative_to(folder).as_posix())
    return found


def check_update_files(update: Path, new: dict, role: str) -> None:
    """The update folder holds exactly what bundle.json lists (+ bundle.json and its signature): the
    shipped adapters (with the sha256 their entries name), the export records and README; no symlink
    anywhere."""
    files = new["files"]
    shipped = {entry["path"]: entry["sha256"] for entry in new["adapters"] if entry["shipped"]}
    for name in sorted(files):
        if name not in shipped and name not in UPDATE_EXTRAS:
            raise UserError(f"{role} ships {name[:120]}: an update adds adapters only (never the "
                            "base, template or tokenizer); install a full bundle to change those")
    for name, digest in shipped.items():
        if files.get(name) != digest:
            raise _refuse(role, f"{name} is shipped but files does "
                                "not list it with its entry's sha256")
    for name in RECORDS:
        if name not in files:
            raise _refuse(role, f"files does not list {name}")
    found = _found_files(update, role) - {BUNDLE_JSON, SIGNATURE}
    for name in sorted(found ^ set(files)):
        where = "holds" if name in found else "lacks"
        raise UserError(f"{role} {where} {name[:120]}, which its bundle.json "
                        f"{'does not list' if name in found else 'lists'}; {_REMAKE}")
