"""Hub ids (``org/name`` or ``name``): how a ``--model`` or ``--data`` argument that is no local
path is told from a path. Ground layer, so that the model loader, the device wing's row readers and
the model card share one rule."""

from __future__ import annotations

import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_hub_id(spec: str) -> bool:
    """Whether ``spec`` (not an existing path) reads as a hub id ``org/name``
    or ``name``, not a path."""
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1
    return not looks_like_path and _HUB_ID.match(spec) is not None
