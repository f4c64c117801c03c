"""Read a corpus from .txt, .jsonl, .json, .csv, .parquet, a directory saved by
``datasets`` or a hub dataset id.

The rows come from the device wing's readers (:func:`slm_align.ondevice.rows.iter_rows`, each with
where it came from); :func:`read_examples` turns them into :class:`Example` objects.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from slm_align.data.examples import Example
from slm_align.data.prompts import chat_message
from slm_align.errors import UserError
from slm_align.ondevice.rows import SUFFIXES, hub_fingerprint, is_hub_dataset, iter_rows
from slm_align.ondevice.tools.specs import normalise_tools

TEXT_FIELDS = ("text", "content", "story", "document", "body", "article", "passage", "sentence")


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
