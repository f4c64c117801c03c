"""Environments for agent episodes: a Python class whose public, typed methods are the tools of one
episode, with state kept between its calls (TRL's ``environment_factory`` contract).

A class is named ``module:Class`` (a task row's ``environment`` column, or ``--environment`` for the
whole file). Per episode: ``env = Class()``, then ``env.reset(**row)`` with the task row's columns
(a string it returns is appended to the last user message, as the episode's first observation);
every public method but ``reset`` and ``get_reward`` becomes a tool (schema from its type hints and
docstring, as :meth:`~slm_align.ondevice.tools.registry.ToolRegistry.register` makes it); rewards
receive the instances as ``environments=`` and may call ``get_reward()``. A tool that raises, or
runs past :data:`TOOL_TIMEOUT_S`, becomes an error observation (the registry's rule), never a
crashed run.

Bad input is refused before any training: a class that cannot be imported, is not a class, has no
``reset``, or has a public method without type hints.

Data never runs code by itself: importing a module runs its code, so a task row's ``environment``
may name a class only from a module the user allowed (``--environment-module NAME``, the recipe's
``rl.environment_modules``; ``--environment``'s own module is allowed by being named). Any other is
refused in one line before anything is imported (:func:`check_allowed`).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

from slm_align.config.named import import_named
from slm_align.errors import UserError
from slm_align.ondevice.tools.registry import ToolRegistry

RESERVED = ("reset", "get_reward")
"""Methods of an environment that are not tools."""
TOOL_TIMEOUT_S = 30.0
"""Longest an environment's method may run before its call becomes an error observation."""


def module_allowed(module: str, allowed: Sequence[str]) -> bool:
    """``module`` is one of ``allowed`` or inside one of them (a package allows its submodules)."""
    return any(module == name or module.startswith(name + ".") for name in allowed)


def check_allowed(spec: Any, allowed: Sequence[str], where: str = "a task row") -> None:
    """Refuse, in one line and before any import, an environment named by task data (``spec``, the
    ``environment`` column of the row ``where``) whose module is not in ``allowed``."""
    if not isinstance(spec, str):
        raise UserError(f"{where}: 'environment' must be text naming module:Class, not "
                        f"{type(spec).__name__}")
    module, _, name = spec.partition(":")
    if not module or not name:
        raise UserError(f"{where}: environment {_shown(spec)}: name it as module:Class (e.g. "
                        "my_envs:Calculator)")
    if not module_allowed(module, allowed):
        raise UserError(f"{where} names the environment {_shown(spec)} from module "
                        f"{_shown(module)}, which is not allowed (importing a module runs its "
                        f"code): pass --environment-module {_shown(module)} (or "
                        "rl.environment_modules in the recipe) if you trust it")


def _shown(text: str, limit: int = 60) -> str:
    """``text`` on one line (repr's escapes), cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")[1:-1]


def load_environment(spec: str) -> type:
    """The class named ``module:Class``, checked (see :func:`check_environment`)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UserError(f"environment {spec}: name it as module:Class (e.g. my_envs:Calculator)")
    found = import_named(spec, "environment")
    check_environment(found, spec)
    return found


def tool_methods(cls: type) -> list[str]:
    """The names of ``cls``'s tools: its public methods other than :data:`RESERVED`, in definition
    order."""
    return [name for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_") and name not in RESERVED]


def check_environment(cls: Any, spec: str) -> None:
    """A class with ``reset`` and at least one tool, each tool with type hints and a docstring."""
    if not inspect.isclass(cls):
        raise UserError(f"environment {spec} is not a class (got {type(cls).__name__})")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(f"environment {spec} has no reset method; give it reset(self, **row)")
    if not tool_methods(cls):
        raise UserError(f"environment {spec} has no public method to offer as a tool")
    for name in tool_methods(cls):
        method = getattr(cls, name)
        hints = {p for p in inspect.signature(method).parameters if p != "self"}
        annotated = set(getattr(method, "__annotations__", {})) - {"return"}
        if hints - annotated:
            missing = ", ".join(sorted(hints - annotated))
            raise UserError(f"environment {spec}: method {name} has no type hint for {missing}; "
                            "tools need typed parameters (their schema comes from the hints)")


def open_environment(cls: type, row: dict) -> tuple[Any, ToolRegistry, Optional[str]]:
    """One episode's environment: a new instance reset with the task row's columns, its tools, and
    the string ``reset`` returned (None when it returned none)."""
    instance = cls()
    observation = instance.reset(**row)
    registry = ToolRegistry(timeout_s=TOOL_TIMEOUT_S)
    for name in tool_methods(cls):
        registry.register(getattr(instance, name), name=name)
    return instance, registry, observation if isinstance(observation, str) else None
