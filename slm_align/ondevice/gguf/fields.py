"""A GGUF file's metadata key/values, read without loading its tensors (nor the ``gguf`` package),
each with the bytes it is stored as, so that it can be copied verbatim."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slm_align.errors import UserError


@dataclass(frozen=True)
class Field:
    """One metadata key/value: its GGUF value type (and item type for arrays), the decoded value,
    and the entry's bytes as stored (key, type, value), so that it can be copied verbatim."""

    type: int
    item_type: int | None
    value: Any
    raw: bytes


_STRING = 8
_ARRAY = 9
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    """Little-endian reads from a buffer, advancing a position."""

    def __init__(self, data):
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self.pos
        self.pos += length
        if self.pos > len(self.data):
            raise struct.error("string past the end of the file")
        return bytes(self.data[start:self.pos]).decode("utf-8", "surrogateescape")

    def numbers(self, item_type: int, count: int) -> list:
        dtype = np.dtype(_NUMPY_TYPES[item_type])
        values = np.frombuffer(self.data, dtype, count, self.pos)
        self.pos += dtype.itemsize * count
        return values.tolist()

    def value(self, value_type: int):
        """One value of ``value_type``; returns (value, item type or None)."""
        if value_type == _STRING:
            return self.string(), None
        if value_type != _ARRAY:
            return self.numbers(value_type, 1)[0], None
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        if item_type == _STRING:
            return [self.string() for _ in range(count)], item_type
        return self.numbers(item_type, count), item_type


def _parse_header(data, prefix: str, tensors: bool = True) -> tuple[dict[str, Field], dict[str, tuple[int, ...]]]:
    """The key/values whose key starts with ``prefix``, and (if ``tensors``) every tensor's shape
    (numpy order, outermost first: GGUF stores ggml's ne, innermost first)."""
    cursor = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (we read versions 2 and 3, little-endian)")
    tensor_count = cursor.unpack("<Q")
    kv_count = cursor.unpack("<Q")
    fields = {}
    for _ in range(kv_count):
        start = cursor.pos
        key = cursor.string()
        value_type = cursor.unpack("<I")
        value, item_type = cursor.value(value_type)
        if key.startswith(prefix):
            fields[key] = Field(value_type, item_type, value, bytes(data[start:cursor.pos]))
    shapes = {}
    # each tensor: name, n_dims (u32), ne[n_dims] (u64), ggml type (u32), data offset (u64)
    for _ in range(tensor_count if tensors else 0):
        name = cursor.string()
        dims = cursor.numbers(10, cursor.unpack("<I"))
        cursor.pos += 4 + 8
        shapes[name] = tuple(reversed(dims))
    return fields, shapes


def _parse_fields(data, prefix: str) -> dict[str, Field]:
    return _parse_header(data, prefix, tensors=False)[0]


def read_header(path: Path, prefix: str = "") -> tuple[dict[str, Field], dict[str, tuple[int, ...]]]:
    """A .gguf's key/values starting with ``prefix`` and its tensors' shapes by name (numpy order:
    a matrix of ``out`` rows of ``in`` values is ``(out, in)``), read from the header only."""
    return _read(path, lambda data: _parse_header(data, prefix))


def read_fields(path: Path, prefix: str = "tokenizer.") -> dict[str, Field]:
    """The key/values of a .gguf whose key starts with ``prefix``, in file
    order (reads the header only).

    gguf-py's GGUFReader parses every tensor too and takes about 30 s on Gemma 3 270M;
    this takes well under one.
    """
    return _read(path, lambda data: _parse_fields(data, prefix))


def _read(path: Path, parse):
    """``parse`` applied to the file mapped in memory; a file that is not GGUF is the user's to
    fix."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0,
                                                   access=mmap.ACCESS_READ) as data:
            return parse(data)
    except (ValueError, KeyError, struct.error, OverflowError, MemoryError) as exc:
        raise UserError(f"{path} is not a GGUF model ({exc}); "
                        "export or download it again") from None
