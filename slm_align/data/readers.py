"""Read a corpus from .txt, .jsonl, .json, .csv, .parquet, a directory saved by
``datasets`` or a hub dataset id.

Every reader yields ``(where, row)`` pairs, ``where`` naming the file and line (or row) so that a
bad row is reported precisely. :func:`read_examples` turns rows into :class:`Example` objects.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from slm_align.data.examples import Example
from slm_align.data.hub import hub_fingerprint, hub_rows, is_hub_dataset
from slm_align.data.prompts import chat_message
from slm_align.errors import UserError
from slm_align.ondevice.tools.specs import normalise_tools

TEXT_FIELDS = ("text", "content", "story", "document", "body", "article", "passage", "sentence")
SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")

Row = tuple[str, Any]


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


def _string(where: str, row: dict, field: str) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise UserError(f"{where}: column '{field}' holds {type(value).__name__}, expected text")
    return value


def _messages(where: str, value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: 'messages' must be a non-empty list of "
                        f"{{role, content}} objects")
    return tuple(chat_message(where, message) for message in value)


def row_to_example(where: str, row: Any, text_field: Optional[str] = None) -> Optional[Example]:
    """One row as an Example, or None for an empty row. Raises UserError naming
    ``where`` for a bad row."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with a text column, got {type(row).__name__}")
    if text_field is not None:
        if text_field not in row:
            raise UserError(f"{where}: no column '{text_field}' (found: "
                            f"{', '.join(map(str, row)) or 'none'})")
        text = _string(where, row, text_field)
        return Example(text=text.strip()) if text.strip() else None
    if "messages" in row:
        tools = normalise_tools(where, row.get("tools"))
        return Example(messages=_messages(where, row["messages"]),
                       tools=tuple(tools) if tools else None)
    if "prompt" in row and "completion" in row:
        prompt = _string(where, row, "prompt")
        completion = _string(where, row, "completion")
        return Example(prompt=prompt, completion=completion) if completion.strip() else None
    for field in TEXT_FIELDS:
        if field in row:
            text = _string(where, row, field)
            return Example(text=text.strip()) if text.strip() else None
    if "prompt" in row and "answer" in row:
        raise UserError(f"{where}: prompt + answer rows are tasks, not a corpus; pass this file "
                        "with --tasks (RL and the gate's reward spread read it), and a corpus of "
                        "text/prompt+completion/messages rows with --data")
    raise UserError(
        f"{where}: no text column (found: {', '.join(map(str, row)) or 'none'}); "
        f"name it with --text-field, or use text/prompt+completion/messages"
    )


def read_examples(path: Path, text_field: Optional[str] = None) -> list[Example]:
    """Every non-empty item of a corpus. An empty corpus is a UserError."""
    examples = [ex for where, row in iter_rows(path)
                if (ex := row_to_example(where, row, text_field)) is not None]
    if not examples:
        raise UserError(f"data {path} holds no documents; give a file with at "
                        "least a few non-empty rows")
    return examples


def fingerprint(path: Path) -> str:
    """sha256 of a file, or of every file in a directory (names and bytes), for manifests."""
    path = Path(path)
    if is_hub_dataset(path, SUFFIXES):
        return hub_fingerprint(str(path))
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
