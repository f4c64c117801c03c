"""Options shared by several commands, and recipe flags documented once: by the recipe field they set.

A recipe flag's help is its field's ``description`` in ``slm_align.config`` and its shown default is the field's
default, so the two cannot drift apart. Its value stays None when the flag is not given, so a TOML recipe wins.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, Optional, Sequence, Union

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from slm_align.config import Recipe, load_recipe
from slm_align.recipe_overrides import merged_overrides, refuse_other_algorithm

JsonFlag = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout.")
CTX_NAMES = ("--ctx", "--ctx-size")
"""The context window's flag, and llama.cpp's spelling of it."""
OUT_NAMES = ("--out", "-o", "--output-dir")
"""A stage's output directory, and TRL's (transformers') spelling of it."""
ConfigOpt = typer.Option(None, "--config", help="TOML recipe; flags override it.")
ChatTemplateOpt = typer.Option(None, "--chat-template", metavar="chatml|FILE",
                               help="Chat template in place of the model's own (base models have none): chatml (the "
                                    "built-in ChatML) or a Jinja template file.")
SetOpt = typer.Option([], "--set", help="Any recipe setting as KEY=VALUE, typed and checked like the TOML "
                      "(--set sft.lora.r=32 --set rl.grpo.loss_type=dr_grpo); repeatable; a named flag wins. "
                      "`slm-align config show` lists every setting.")

@dataclass(frozen=True)
class RecipeField:
    """One recipe setting: its dotted key, pydantic field and default (as in ``Recipe()``)."""

    key: str
    info: FieldInfo
    default: Any


def _nested_model(annotation: Any) -> Optional[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def recipe_field(key: str, root: type[BaseModel] = Recipe) -> RecipeField:
    """Find the setting ``key`` ("sft.lora.r", "rl.grpo.beta") by walking the recipe's models."""
    model: Optional[type[BaseModel]] = root
    value: Any = root()
    info: Optional[FieldInfo] = None
    for name in key.split("."):
        if model is None or name not in model.model_fields:
            raise KeyError(f"no recipe setting {key}")
        info = model.model_fields[name]
        value = getattr(value, name)
        model = _nested_model(info.annotation)
    return RecipeField(key, info, value)


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (Union, UnionType):
        kept = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(kept) == 1:
            return kept[0]
    return annotation


def _choices(annotation: Any) -> tuple:
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return ()


def cli_type(field: RecipeField) -> Any:
    """The command-line type of a setting: its field type without None; a Literal's choices arrive as str."""
    annotation = _without_none(field.info.annotation)
    if _choices(annotation):
        return str
    if annotation not in (int, float, str):
        raise TypeError(f"{field.key} is a {annotation}; give its flag a parse function")
    return annotation


def shown_default(value: Any) -> Optional[str]:
    """A setting's default as a user would type it on the command line; None when there is nothing to show."""
    if value is None or isinstance(value, bool) or value == [] or value == {}:
        return None
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ",".join(f"{name}={weight:g}" for name, weight in value.items())
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return str(value)


def recipe_help(key: str, note: str = "") -> str:
    """The help of a recipe flag: the field's description, its choices when it has a fixed set, then ``note``."""
    field = recipe_field(key)
    parts = [field.info.description or ""]
    choices = _choices(field.info.annotation)
    if choices:
        parts.append(f"One of: {', '.join(choices)}.")
    if note:
        parts.append(note)
    return " ".join(part for part in parts if part)


def recipe_option(key: str, *names: str, note: str = "", **option: Any) -> Any:
    """A ``typer.Option`` for the recipe setting ``key``: help from its description, shown default from its
    default, value None unless given. ``note`` adds command-line syntax (e.g. "Repeatable.")."""
    shown = shown_default(recipe_field(key).default)
    return typer.Option(None, *names, help=recipe_help(key, note), show_default=shown or True, **option)


@dataclass(frozen=True)
class Flag:
    """One command-line flag that sets one recipe setting (``key``, dotted as in ``load_recipe`` overrides).

    A value flag takes the field's type. ``sets``: a switch that sets the field to this value when given.
    ``repeat``: given several times, collected into a list. ``parse``: turns the flag's text into the value.
    ``help``: own help, only for a flag whose meaning is not the field's (a switch that turns a guard off).
    ``aliases``: other names users know (TRL's ``--num-generations``), accepted as they are, no note.
    """

    name: str
    key: str
    short: Optional[str] = None
    sets: Any = None
    repeat: bool = False
    parse: Optional[Callable[[str], Any]] = None
    note: str = ""
    help: Optional[str] = None
    aliases: tuple[str, ...] = ()

    @property
    def param(self) -> str:
        """The Python parameter name Typer passes the value as ("--max-steps" -> "max_steps")."""
        return self.name.lstrip("-").replace("-", "_")

    def annotation(self) -> Any:
        """The parameter's type as Typer reads it."""
        if self.sets is not None:
            return bool
        if self.repeat:
            return list[str]
        if self.parse is not None:
            return Optional[str]
        return Optional[cli_type(recipe_field(self.key))]

    def option(self) -> Any:
        """The ``typer.Option`` that parses this flag."""
        names = [self.name, *self.aliases] + ([self.short] if self.short else [])
        if self.sets is not None:
            return typer.Option(False, *names, help=self.help or recipe_help(self.key, self.note))
        if self.repeat:
            return typer.Option([], *names, help=self.help or recipe_help(self.key, self.note))
        return recipe_option(self.key, *names, note=self.note)

    def override(self, given: Any) -> Any:
        """The ``load_recipe`` override for the flag's parsed value; None when it was not given."""
        if self.sets is not None:
            return self.sets if given else None
        if self.repeat:
            return list(given) or None
        if self.parse is not None and given is not None:
            return self.parse(given)
        return given

    def parameter(self) -> inspect.Parameter:
        """The flag as a keyword parameter of a command's signature."""
        return inspect.Parameter(self.param, inspect.Parameter.KEYWORD_ONLY, default=self.option(),
                                 annotation=self.annotation())


ALLOW_PICKLE = Flag("--allow-pickle", "model.allow_pickle", sets=True)
"""The one switch that lets pickle checkpoints and adapters (``.bin``) load, on every command that loads them."""

DEVICE = Flag("--device", "compute.device")
"""Where a command computes; every command that loads a model for torch takes it."""


def _signature_with(command: Callable, flags: Sequence[Flag]) -> inspect.Signature:
    signature = inspect.signature(command, eval_str=True)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name == "settings":
            parameters.extend(flag.parameter() for flag in flags)
            parameters.append(inspect.Parameter("set_values", inspect.Parameter.KEYWORD_ONLY, default=SetOpt,
                                                annotation=list[str]))
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return signature.replace(parameters=parameters)


def recipe_flags(*tables: Sequence[Flag]) -> Callable[[Callable], Callable]:
    """Give a command the options of the flags in ``tables``, in place of its ``settings`` parameter.

    Typer reads the generated signature; the command is called with ``settings``, the ``load_recipe``
    overrides ({dotted key: value}, None for each flag not given) made from those flags in one place.
    """
    flags = [flag for table in tables for flag in table]

    def decorate(command: Callable) -> Callable:
        """Wrap ``command``; Typer sees the generated signature, the command sees ``settings``."""

        @functools.wraps(command)
        def with_settings(**given: Any) -> Any:
            """Call the command with the flags' values and ``--set`` gathered into ``settings``; a flag of the
            other RL algorithm is refused here, before any work."""
            named = {}
            for flag in flags:
                named[flag.key] = flag.override(given.pop(flag.param))
            settings = merged_overrides(given.pop("set_values"), named)
            if "rl.algo" in named:
                algo = recipe_from(given.get("config"), settings).rl.algo
                given_flags = {flag.key: flag.name for flag in flags if named[flag.key] is not None}
                refuse_other_algorithm(algo, settings, given_flags)
            return command(settings=settings, **given)

        signature = _signature_with(command, flags)
        with_settings.__signature__ = signature
        with_settings.__annotations__ = {name: p.annotation for name, p in signature.parameters.items()}
        return with_settings

    return decorate


def recipe_from(config: Optional[Path], overrides: Optional[dict[str, Any]] = None) -> Recipe:
    """The recipe: the TOML file (optional) with the given flags' overrides (None values skipped)."""
    return load_recipe(config, overrides)
