"""A .gguf model source, dequantized once into a cached HF directory that every
later load reads in seconds.

Loading a llama.cpp file through transformers parses its metadata several times and dequantizes
every tensor: on the real Gemma 3 270M (262k-token vocabulary) that is about 150 s of two CPU cores,
in every stage (SFT, the gate, reward, RL, merge, export's reference model). The first load writes
the fp32 model, its verified tokenizer and the file's ``tokenizer.*`` fields (``tokenizer.gguf``) to
``$SLM_ALIGN_CACHE/gguf/<sha256>/`` (default ``~/.cache/slm-align``); later loads of the same bytes
read that directory. The key is the file's content hash, so an edited or replaced file is never
served stale, and the entry appears atomically (built beside its final name, then renamed), so an
interrupted first load leaves nothing that looks whole.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from slm_align.atomic import publish_directory, scratch_directory, write_json_atomic

CACHE_ENV = "SLM_ALIGN_CACHE"
RECORD = "gguf-source.json"


def cache_root() -> Path:
    """``$SLM_ALIGN_CACHE`` or ``~/.cache/slm-align``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "slm-align")


def file_sha256(path: Path) -> str:
    """The content hash of ``path``, computed once per (path, size, mtime) in a process."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(functools.partial(handle.read, 1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_dir(path: Path) -> Path:
    """Where the HF directory of ``path`` lives (whether or not it exists yet)."""
    return cache_root() / "gguf" / file_sha256(path)


def is_complete(directory: Path) -> bool:
    """A cache entry is whole when its record is there (written last, before the rename)."""
    return (directory / RECORD).is_file()


def materialize(path: Path, load_model: Callable[[], object], load_tokenizer: Callable[[], object],
                save_tokenizer: Callable[[object, Path], None]) -> Path:
    """The cached HF directory of the .gguf ``path``, built with the given loaders on first use.

    ``load_model()`` and ``load_tokenizer()`` read the file itself; ``save_tokenizer(tokenizer,
    directory)`` saves the tokenizer with the file's ``tokenizer.*`` fields beside it.
    """
    final = cached_dir(path)
    if is_complete(final):
        return final
    with scratch_directory(final) as partial:
        # the tokenizer first: one we cannot carry is refused before minutes of dequantizing
        tokenizer = load_tokenizer()
        model = load_model()
        model.save_pretrained(partial, safe_serialization=True)
        save_tokenizer(tokenizer, partial)
        record = {"gguf": str(path.resolve()), "sha256": final.name, "bytes": path.stat().st_size}
        write_json_atomic(partial / RECORD, record)
        _publish(partial, final)
    return final


def _publish(partial: Path, final: Path) -> None:
    """Rename ``partial`` into place; when another process got there first, keep theirs
    (same bytes, same key)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        publish_directory(partial, final)
    except OSError:
        if not is_complete(final):
            shutil.rmtree(final, ignore_errors=True)
            publish_directory(partial, final)
