"""The skips a test run may show under ``CI=true``, in one place.

Each is a reason no set-up step can remove: the hardware of the machine. Under ``CI=true`` (``.ci/run`` sets it)
every other skip fails the run (``tests/conftest.py``): a package the dev extra installs that does not import,
llama.cpp's reference converter that did not build, a missing Chromium, a file root can read. A broken install must
not land green.
"""

from __future__ import annotations

import os

ALLOWED_SKIPS = (
    "needs a CUDA GPU",  # tests marked gpu, run by scripts/gpu_check.sh on a GPU machine
    "this machine has CUDA",  # a CPU-only behaviour (the device refusal) that a CUDA machine cannot show
    "this machine has Apple's GPU",  # the same on a Mac with MPS
)
"""Substrings of the skip reasons allowed under CI=true."""


def strict_skips() -> bool:
    """Whether this run refuses skips outside :data:`ALLOWED_SKIPS` (``CI`` set to true)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_reason(longrepr) -> str:
    """The reason of a skipped report: pytest keeps it as ``(path, line, "Skipped: reason")``."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def allowed_skip(reason: str) -> bool:
    return any(allowed in reason for allowed in ALLOWED_SKIPS)
