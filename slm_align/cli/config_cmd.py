"""``slm-align config show``: the resolved recipe (the TOML file, then ``--set``), each setting with
its doc line and its default."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import typer
from pydantic import BaseModel

from slm_align.cli.options import ConfigOpt, JsonFlag, SetOpt, recipe_from
from slm_align.cli.render import emit, stdout
from slm_align.config import Recipe
from slm_align.config.overrides import parse_sets

config_app = typer.Typer(no_args_is_help=True, help="Inspect recipes: every setting, its "
                                                    "meaning and its default.")


def settings_of(recipe: BaseModel, default: BaseModel, prefix: str = "") -> Iterator[dict[str, Any]]:
    """Every leaf setting of ``recipe``: dotted key, value, default and doc line; a section's own
    settings before its sub-sections (as TOML tables must come)."""
    fields = type(recipe).model_fields
    sections = [name for name in fields if isinstance(getattr(recipe, name), BaseModel)]
    for name, info in fields.items():
        if name not in sections:
            yield {"key": f"{prefix}{name}", "value": getattr(recipe, name), "default": getattr(default, name),
                   "doc": info.description or ""}
    for name in sections:
        yield from settings_of(getattr(recipe, name), getattr(default, name), f"{prefix}{name}.")


def toml_value(value: Any) -> str:
    """A value as TOML writes it (``true``, ``"text"``, ``["a", "b"]``, ``{ a = 1.0 }``)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{name} = {toml_value(item)}" for name, item in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value)


def _line(setting: dict[str, Any]) -> str:
    """``name = value  # doc (default: x)``; an unset (None) setting is commented
    out, as TOML has no null."""
    name = setting["key"].rsplit(".", 1)[-1]
    if setting["value"] is None:
        assignment = f"# {name} = (unset)"
    else:
        assignment = f"{name} = {toml_value(setting['value'])}"
    default = "unset" if setting["default"] is None else toml_value(setting["default"])
    return f"{assignment}  # {setting['doc']} (default: {default})"


def print_recipe(settings: list[dict[str, Any]]) -> None:
    """The recipe as TOML with one comment per setting, under ``[section]`` headers."""
    lines = []
    section = ""
    for setting in settings:
        owner = setting["key"].rpartition(".")[0]
        if owner != section:
            lines.append(f"\n[{owner}]")
            section = owner
        lines.append(_line(setting))
    stdout.print("\n".join(lines).lstrip("\n"), highlight=False, markup=False, soft_wrap=True)


@config_app.command("show", epilog="Examples:\n\n  slm-align config show\n\n  slm-align config "
                                   "show --config recipe.toml --set rl.algo=grpo --set "
                                   "sft.lora.r=32\n\n  slm-align config show > recipe.toml   # "
                                   "every setting, as a recipe to edit\n\n  "
                                   "slm-align config show --json")
def show(config: Optional[Path] = ConfigOpt, set_values: list[str] = SetOpt, as_json: bool = JsonFlag) -> None:
    """Print the resolved recipe (the TOML file, then --set) with each
    setting's doc line and default."""
    recipe = recipe_from(config, parse_sets(set_values))
    settings = list(settings_of(recipe, Recipe()))
    emit(as_json, {s["key"]: {k: v for k, v in s.items() if k != "key"} for s in settings},
         partial(print_recipe, settings))
