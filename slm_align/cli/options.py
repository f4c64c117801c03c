"""Options shared by several commands, and flags documented once: by the typed field they set.

A recipe flag's help is its field's ``description`` in ``slm_align.config`` and its shown default
is the field's default, so the two cannot drift apart. Its value stays None when the flag is not
given, so a TOML recipe wins.

A runtime flag (`chat`'s sampling flags) is made from a field of a typed settings model of the agent
runtime (:class:`slm_align.ondevice.agent.settings.Sampling`): help, default and bounds are the field's, and
a value out of bounds is refused in the words the server's 400 uses for the same field
(:mod:`slm_align.ondevice.agent.bounds`).
"""

from __future__ import annotations

import functools
import inspect
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, Optional, Sequence, Union

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from slm_align.config import Recipe, load_recipe
from slm_align.config.overrides import merged_overrides, refuse_other_algorithm
from slm_align.errors import UserError
from slm_align.ondevice.agent.bounds import Typed, accepted, members, of_field, refusal, typed
from slm_align.ondevice.devices.host import default_threads

JsonFlag = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout.")
CTX_NAMES = ("--ctx", "--ctx-size")
"""The context window's flag, and llama.cpp's spelling of it."""
OUT_NAMES = ("--out", "-o", "--output-dir")
"""A stage's output directory, and TRL's (transformers') spelling of it."""
ConfigOpt = typer.Option(None, "--config", help="TOML recipe; flags override it.")
ChatTemplateOpt = typer.Option(None, "--chat-template", metavar="chatml|FILE",
                               help="Chat template in place of the model's own (base models have "
                                    "none): chatml (the built-in ChatML) or a Jinja template file.")
THREADS_PER_CORE = 2
"""The most threads --threads may ask for per core of this host: more only thrashes, and far more crashes
llama.cpp (100,000 segfaulted, 5,000 hung in libgomp)."""


def threads_within_cores(value: Optional[int]) -> Optional[int]:
    """``--threads`` as given, or refused above :data:`THREADS_PER_CORE` per core of this host."""
    cores = os.cpu_count() or 1
    if value is not None and value > THREADS_PER_CORE * cores:
        raise typer.BadParameter(f"{value} is more than this host's {cores} cores can run (at most "
                                 f"{THREADS_PER_CORE * cores})")
    return value


CtxOpt = typer.Option(None, *CTX_NAMES, min=16, help="Context window in tokens.")
CallThresholdOpt = typer.Option(None, "--call-threshold", help="The call rule: a reply calls a tool exactly when "
                                "the model's probability of opening a call is at least this, a number from 0 to "
                                "1 (0.5: by the larger mass; default: off, the likeliest token decides).")
SetOpt = typer.Option([], "--set", help="Any recipe setting as KEY=VALUE, typed and checked like "
                      "the TOML (--set sft.lora.r=32 --set rl.grpo.loss_type=dr_grpo); repeatable; "
                      "a named flag wins. `slm-align config show` lists every setting.")

PANELS = {
    "model": "Source", "data": "Data", "seed": "Data", "sft": "SFT", "reward": "Reward model",
    "headroom": "Headroom gate", "rl": "RL (common)", "rl.ppo": "PPO", "rl.grpo": "GRPO",
    "rl.envelope": "Safety envelope", "rl.watchdog": "Watchdog", "preference": "DPO / KTO",
    "preference.desirable_weight": "KTO", "preference.undesirable_weight": "KTO", "compute": "Compute",
    "tracking": "Tracking",
}
"""The ``--help`` panel of a recipe flag, by the most specific section of its key that is listed."""
PANEL_ORDER = list(dict.fromkeys(PANELS.values()))
"""Panels as the loop runs: where the model and data come from, SFT, the reward model,
the gate, RL, DPO/KTO."""


def panel_of(key: str) -> str:
    """The ``--help`` panel of the recipe setting ``key``: ``rl.grpo.beta`` -> GRPO,
    ``rl.steps`` -> RL (common)."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        section = ".".join(parts[:end])
        if section in PANELS:
            return PANELS[section]
    raise KeyError(f"no --help panel for the recipe setting {key}")


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
    """The command-line type of a setting: its field type without None; a Literal's
    choices arrive as str."""
    annotation = _without_none(field.info.annotation)
    if _choices(annotation):
        return str
    if annotation not in (int, float, str):
        raise TypeError(f"{field.key} is a {annotation}; give its flag a parse function")
    return annotation


def shown_default(value: Any) -> Optional[str]:
    """A setting's default as a user would type it on the command line; None when
    there is nothing to show."""
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
    """The help of a recipe flag: the field's description, its choices when it has a
    fixed set, then ``note``."""
    field = recipe_field(key)
    parts = [field.info.description or ""]
    choices = _choices(field.info.annotation)
    if choices:
        parts.append(f"One of: {', '.join(choices)}.")
    if note:
        parts.append(note)
    return " ".join(part for part in parts if part)


def recipe_option(key: str, *names: str, note: str = "", **option: Any) -> Any:
    """A ``typer.Option`` for the recipe setting ``key``: help from its description,
    shown default from its default, value None unless given. ``note`` adds command-line
    syntax (e.g. "Repeatable.")."""
    shown = shown_default(recipe_field(key).default)
    return typer.Option(None, *names, help=recipe_help(key, note), show_default=shown or True, **option)


@dataclass(frozen=True)
class Flag:
    """One command-line flag that sets one recipe setting (``key``, dotted as in
    ``load_recipe`` overrides).

    A value flag takes the field's type. ``sets``: a switch that sets the field to this value when
    given. ``repeat``: given several times, collected into a list. ``parse``: turns the flag's text
    into the value. ``help``: own help, only for a flag whose meaning is not the field's (a switch
    that turns a guard off). ``aliases``: other names users know (TRL's ``--num-generations``),
    accepted as they are, no note. ``minimum`` and ``callback``: checks at parse time, before the
    recipe is read. Its ``--help`` panel is its key's section's (:func:`panel_of`).
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
    minimum: Optional[int] = None
    callback: Optional[Callable[[Any], Any]] = None

    @property
    def param(self) -> str:
        """The Python parameter name Typer passes the value as ("--max-steps" -> "max_steps")."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def help_panel(self) -> str:
        """The ``--help`` panel the flag is listed in."""
        return panel_of(self.key)

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
        panel = self.help_panel
        if self.sets is not None:
            return typer.Option(False, *names, help=self.help or recipe_help(self.key, self.note),
                                rich_help_panel=panel)
        if self.repeat:
            return typer.Option([], *names, help=self.help or recipe_help(self.key, self.note), rich_help_panel=panel)
        checks = {"min": self.minimum, "callback": self.callback}
        checks = {name: check for name, check in checks.items() if check is not None}
        return recipe_option(self.key, *names, note=self.note, rich_help_panel=panel, **checks)

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
"""The one switch that lets pickle checkpoints and adapters (``.bin``) load, on every
command that loads them."""

DEVICE = Flag("--device", "compute.device")
"""Where a command computes; every command that loads a model for torch takes it."""

THREADS = Flag("--threads", "compute.threads", minimum=1, callback=threads_within_cores)
"""CPU threads of every command that computes: a recipe flag of the training commands, and
:data:`ThreadsOpt` (the same option) of the others."""
ThreadsOpt = THREADS.option()


def use_threads(threads: Optional[int]) -> int:
    """Give this process's PyTorch ``threads`` CPU threads (else :func:`default_threads`), once, at
    a command's start, before any model loads; the number. PyTorch's inter-op pool gets as many
    where torch still allows it (it refuses once inter-op work has run, or the second time in one
    process). llama.cpp takes the number from each backend (``n_threads``, ``n_threads_batch``):
    the RL sampler reads it back from torch."""
    import torch

    chosen = threads or default_threads()
    torch.set_num_threads(chosen)
    try:
        torch.set_num_interop_threads(chosen)
    except RuntimeError:  # inter-op work has run, or it was set before in this process: leave it
        pass
    return chosen


def _signature_replacing(command: Callable, name: str, replacement: list[inspect.Parameter]) -> inspect.Signature:
    """``command``'s signature, keyword-only, with its parameter ``name``
    replaced by ``replacement``."""
    signature = inspect.signature(command, eval_str=True)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name == name:
            parameters.extend(replacement)
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return signature.replace(parameters=parameters)


def _shown_to_typer(wrapper: Callable, signature: inspect.Signature) -> Callable:
    """``wrapper`` with ``signature`` as the one Typer reads."""
    wrapper.__signature__ = signature
    wrapper.__annotations__ = {name: p.annotation for name, p in signature.parameters.items()}
    return wrapper


def recipe_flags(*tables: Sequence[Flag]) -> Callable[[Callable], Callable]:
    """Give a command the options of the flags in ``tables``, in place of
    its ``settings`` parameter.

    Typer reads the generated signature; the command is called with ``settings``, the
    ``load_recipe`` overrides ({dotted key: value}, None for each flag not given) made from
    those flags in one place.
    """
    flags = [flag for table in tables for flag in table]

    def decorate(command: Callable) -> Callable:
        """Wrap ``command``; Typer sees the generated signature, the command sees ``settings``."""

        @functools.wraps(command)
        def with_settings(**given: Any) -> Any:
            """Call the command with the flags' values and ``--set`` gathered into ``settings``; a
            flag of the other RL algorithm is refused here, before any work."""
            named = {}
            for flag in flags:
                named[flag.key] = flag.override(given.pop(flag.param))
            settings = merged_overrides(given.pop("set_values"), named)
            if "rl.algo" in named:
                algo = recipe_from(given.get("config"), settings).rl.algo
                given_flags = {flag.key: flag.name for flag in flags if named[flag.key] is not None}
                refuse_other_algorithm(algo, settings, given_flags)
            if THREADS.key in named:  # the command computes: its threads are set before its work
                use_threads(recipe_from(given.get("config"), settings).compute.threads)
            return command(settings=settings, **given)

        set_values = inspect.Parameter("set_values", inspect.Parameter.KEYWORD_ONLY, default=SetOpt,
                                       annotation=list[str])
        listed = sorted(flags, key=lambda flag: PANEL_ORDER.index(flag.help_panel))  # panels in the loop's order
        parameters = [flag.parameter() for flag in listed] + [set_values]
        return _shown_to_typer(with_settings, _signature_replacing(command, "settings", parameters))

    return decorate


def recipe_from(config: Optional[Path], overrides: Optional[dict[str, Any]] = None) -> Recipe:
    """The recipe: the TOML file (optional) with the given flags' overrides
    (None values skipped)."""
    return load_recipe(config, overrides)


def _scalar(kind: Typed) -> type:
    """The command-line type of a typed field: float for a number, else its one type (int, str)."""
    found = {typed(member).annotation for member in members(kind.annotation)}
    return float if float in found else found.pop()


def _flag_name(field: str, renamed: dict[str, str]) -> str:
    """A field's flag: ``--top-p`` for ``top_p``, unless ``renamed`` spells it otherwise."""
    return renamed.get(field) or "--" + field.replace("_", "-")


def typed_option(info: FieldInfo, name: str) -> Any:
    """The ``typer.Option`` of a typed field: default the field's, help its
    description and what it accepts."""
    kind = of_field(info)
    bound = accepted(kind.annotation, kind.metadata)
    return typer.Option(info.default, name, help=f"{info.description} "
                        f"{bound[0].upper()}{bound[1:]}.")


def typed_flags(model: type[BaseModel], param: str, renamed: Optional[dict[str, str]] = None) -> Callable:
    """Give a command one flag per field of ``model`` in place of its parameter ``param``, which the
    command then receives as a validated ``model``. A value the field refuses is a one-line
    UserError naming the flag and what it accepts, before the command runs (``--temperature must be
    a number from 0 to 2, got 3.0``)."""
    renamed = renamed or {}
    names = {field: _flag_name(field, renamed) for field in model.model_fields}

    def decorate(command: Callable) -> Callable:
        """Wrap ``command``; Typer sees one option per field, the command sees ``param``."""

        @functools.wraps(command)
        def with_model(**given: Any) -> Any:
            """Call the command with the fields' flags gathered into one validated ``model``."""
            values = {field: given.pop(field) for field in names}
            try:
                given[param] = model.model_validate(values)
            except ValidationError as exc:
                error = exc.errors(include_url=False)[0]
                field = error["loc"][0]
                raise UserError(refusal(names[field], of_field(model.model_fields[field]), error)) from None
            return command(**given)

        parameters = [inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY, annotation=_scalar(of_field(info)),
                                        default=typed_option(info, names[field]))
                      for field, info in model.model_fields.items()]
        return _shown_to_typer(with_model, _signature_replacing(command, param, parameters))

    return decorate
