"""``tomllib`` on Python 3.11+, the ``tomli`` backport (the same API) on
3.10: import it from here."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pyproject declares tomli for it
    import tomli as tomllib

__all__ = ["tomllib"]
