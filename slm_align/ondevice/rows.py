"""Rows of a task or corpus file: .txt, .jsonl, .json, .csv, .parquet, a directory saved by
``datasets``, or a hub dataset id (``--data org/name``, read through ``datasets.load_dataset`` when
its cache or the network has it; one clear line when neither does).

Every reader yields ``(where, row)`` pairs, ``where`` naming the file and line (or row) so that a
bad row is reported precisely. Torch-free (pyarrow and datasets are imported on first use): the
runtime's ``evaluate-agent`` reads task files through it, and :mod:`slm_align.data.readers` builds
the training corpus on it.
"""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path
from typing import Any, Iterator

from slm_align.config.hub_ids import looks_like_hub_id
from slm_align.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")

Row = tuple[str, Any]


def is_hub_dataset(path: Path, file_suffixes: tuple[str, ...]) -> bool:
    """A data argument that is no local path and reads as a hub id (``org/name``):
    no file suffix of ours."""
    if path.exists() or path.suffix.lower() in file_suffixes:
        return False
    return looks_like_hub_id(str(path))


@functools.lru_cache(maxsize=4)
def load_hub_dataset(name: str) -> Any:
    """The dataset's train split (else its first), from the datasets cache or the hub;
    UserError when unreachable."""
    import datasets

    try:
        loaded = datasets.load_dataset(name)
    except Exception as exc:
        # offline, unknown id, gated: datasets raises ConnectionError, FileNotFoundError, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"data {name}: no such file, and not a dataset the datasets cache or the "
                        f"hub has ({reason}); pass a local corpus file, or the hub id of a dataset "
                        "while online") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    return loaded


def hub_rows(name: str) -> Iterator[tuple[str, Any]]:
    """The dataset's rows, each with where it came from (``org/name:row 7``)."""
    for index, row in enumerate(load_hub_dataset(name)):
        yield f"{name}:row {index + 1}", row


def hub_fingerprint(name: str) -> str:
    """The dataset's id and the fingerprint datasets computed for its loaded
    contents, for manifests."""
    return f"hub:{name}:{load_hub_dataset(name)._fingerprint}"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset "
                        f"{exc.start}); re-save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror}); check the "
                        "path and its permissions") from None


def _txt_rows(path: Path) -> Iterator[Row]:
    block: list[str] = []
    start = 0
    for number, line in enumerate(_read_text(path).splitlines() + [""], start=1):
        if line.strip():
            if not block:
                start = number
            block.append(line.strip())
        elif block:
            yield f"{path}:{start}", {"text": " ".join(block)}
            block = []


def _jsonl_rows(path: Path) -> Iterator[Row]:
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not valid JSON ({exc.msg}); each line "
                            "must be one JSON object") from None


def _json_rows(path: Path) -> Iterator[Row]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of objects (or {{'data': [...]}}), got "
                        f"{type(data).__name__}")
    for index, row in enumerate(data):
        yield f"{path}[{index}]", row


def _csv_rows(path: Path) -> Iterator[Row]:
    reader = csv.DictReader(_read_text(path).splitlines())
    for row in reader:
        yield f"{path}:{reader.line_num}", row


def _table_rows(label: str, rows: list[dict]) -> Iterator[Row]:
    for index, row in enumerate(rows):
        yield f"{label}[row {index}]", row


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise UserError(f"{path}: not a readable parquet file "
                        f"({type(exc).__name__}: {exc})") from None
    yield from _table_rows(str(path), table.to_pylist())


def _datasets_rows(path: Path) -> Iterator[Row]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError or its own errors
        raise UserError(f"{path}: not a directory saved by datasets.save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    yield from _table_rows(str(path), loaded.to_list())


def iter_rows(path: Path) -> Iterator[Row]:
    """Rows of any supported corpus format, with where each came from."""
    path = Path(path)
    if is_hub_dataset(path, SUFFIXES):
        return hub_rows(str(path))
    if not path.exists():
        raise UserError(f"data {path} not found; pass a corpus file ({', '.join(SUFFIXES)}) "
                        "or a datasets directory")
    if path.is_dir():
        return _datasets_rows(path)
    readers = {".txt": _txt_rows, ".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows,
               ".parquet": _parquet_rows}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise UserError(f"data {path}: unsupported format {path.suffix or '(none)'}; use one of "
                        f"{', '.join(SUFFIXES)}")
    return reader(path)
