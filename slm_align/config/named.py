"""An object named ``module:attribute`` on the command line (a user's reward function, an
environment class), imported or refused in one line."""

from __future__ import annotations

import importlib
from typing import Any

from slm_align.errors import UserError


def import_named(spec: str, what: str) -> Any:
    """The attribute ``spec`` (``module:attribute``) names; a one-line UserError starting with
    ``what`` and ``spec`` when the module does not import or lacks it."""
    module_name, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except ImportError as exc:
        raise UserError(f"{what} {spec}: cannot import module {module_name} "
                        f"({exc}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise UserError(f"{what} {spec}: module {module_name} has no {attribute}") from None
