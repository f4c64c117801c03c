"""Publishing files and directories atomically: a reader sees the old version or the
whole new one, never half.

Every writer of the package goes through here. The pattern is always the same: write under a hidden
temporary name beside the target (same filesystem, so the rename is atomic), flush it to disk,
rename it into place, then flush the parent directory so the rename itself survives a power cut. On
any error the temporary is removed and the target is left as it was. A folder is built the same
way, in a scratch folder beside it (:func:`building_directory`, :func:`scratch_directory`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk; a failure (ENOSPC, EIO: the data is not safe) raises."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Flush a directory's entry list (a rename) to disk, where the
    platform and filesystem allow it.

    Best effort: Windows cannot open a directory, and some filesystems refuse fsync on one (EINVAL).
    """
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        fsync_file(file)


@contextlib.contextmanager
def atomic_paths(*targets: Path, mode: int = 0) -> Iterator[list[Path]]:
    """Temporary paths beside ``targets`` for the caller (or a tool) to write; all
    renamed in place on success.

    Every temporary is written and flushed before the first rename, so a failure while writing (a
    full disk, an exception) publishes none of them. ``mode`` (e.g. ``0o600``) sets the
    permissions of the published files.
    """
    temps = []
    try:
        for target in targets:
            target = Path(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            temps.append(Path(tmp))
        yield temps
        for tmp in temps:
            if mode:
                os.chmod(tmp, mode)
            fsync_file(tmp)
        for tmp, target in zip(temps, targets):
            os.replace(tmp, target)
            fsync_directory(Path(target).parent)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(target: Path, mode: int = 0) -> Iterator[Path]:
    """One temporary path beside ``target``, renamed into place when the ``with`` block succeeds."""
    with atomic_paths(target, mode=mode) as temps:
        yield temps[0]


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path, mode=mode) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: Path, text: str, mode: int = 0) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes_atomic(path, text.encode("utf-8"), mode=mode)


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write ``data`` as indented, key-sorted JSON to ``path`` atomically."""
    return write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def jsonl_text(rows: Iterable[dict[str, Any]]) -> str:
    """One JSON object per line (non-ASCII kept as is), the format of every ``.jsonl`` we write."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def publish_directory(built: Path, final: Path, replace: bool = False) -> Path:
    """Flush every file of the finished directory ``built``, then rename it to ``final``.

    With ``replace`` an existing ``final`` is removed first (the one moment a reader can
    find nothing; callers that must never lose the old version leave ``replace`` off and
    refuse an existing target).
    """
    built = Path(built)
    final = Path(final)
    _fsync_tree(built)
    if replace and final.exists():
        if final.is_dir():
            shutil.rmtree(final)
        else:
            final.unlink()
    os.replace(built, final)
    fsync_directory(final.parent)
    return final


def _writer_gone(scratch: Path) -> bool:
    """Whether the process that made ``scratch`` (``.NAME.PID.partial``) has ended (it was killed
    mid-way). Unknown where a process cannot be probed without a signal (Windows): kept."""
    pid = scratch.name.removesuffix(".partial").rpartition(".")[2]
    if os.name == "nt" or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def scratch_beside(final: Path) -> Path:
    """A new hidden scratch folder ``.NAME.PID.partial`` beside ``final``, its own per writing
    process; what a killed writer left there is removed first (a live one's is left alone)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in final.parent.glob(f".{glob.escape(final.name)}.*.partial"):
        if _writer_gone(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
    scratch = final.with_name(f".{final.name}.{os.getpid()}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    return scratch


@contextlib.contextmanager
def scratch_directory(final: Path) -> Iterator[Path]:
    """A scratch folder beside ``final`` (:func:`scratch_beside`) for the ``with`` block, removed
    when it ends, whatever happened (only a killed process leaves it, for the next writer to
    clear)."""
    scratch = scratch_beside(final)
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def building_directory(final: Path, replace: bool = False) -> Iterator[Path]:
    """A scratch folder to build the folder ``final`` in, published at ``final``
    (:func:`publish_directory`, ``replace`` as there) when the ``with`` block succeeds.

    An exception in the block publishes nothing and leaves an existing ``final`` as it was; the
    scratch folder is gone either way.
    """
    with scratch_directory(final) as scratch:
        yield scratch
        publish_directory(scratch, final, replace=replace)
