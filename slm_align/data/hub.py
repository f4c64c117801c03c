"""Datasets by hub id (``--data org/name``): read through ``datasets.load_dataset`` when its cache
or the network has them; one clear line when neither does (offline, or no such dataset)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterator

from slm_align.errors import UserError
from slm_align.modeling.models import looks_like_hub_id


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
