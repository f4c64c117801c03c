"""Recipe settings from the command line: ``--set key=value`` parsed into ``load_recipe`` overrides,
and the refusal of flags that belong to the other RL algorithm.

A value is read as a TOML value (``32``, ``1e-3``, ``true``, ``["q_proj", "v_proj"]``, ``"text"``);
one that is not TOML is taken as a bare string (``--set rl.algo=grpo``). ``load_recipe`` then types
and validates it like the TOML recipe, so the same setting gives the same error from either place.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from slm_align.config import RL_SECTIONS, Recipe, section_of
from slm_align.config.rl import algorithm_candidates
from slm_align.config.tomlcompat import tomllib
from slm_align.errors import UserError


def _nested(model: type[BaseModel], name: str) -> Optional[type[BaseModel]]:
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def is_recipe_key(key: str) -> bool:
    """Whether ``key`` names a recipe setting (``sft.lora.r``), flat RL keys
    included (``rl.beta``)."""
    model: Optional[type[BaseModel]] = Recipe
    names = key.split(".")
    if names[:1] == ["rl"] and len(names) == 2 and section_of(names[1]) is not None:
        return True
    for name in names:
        if model is None or name not in model.model_fields:
            return False
        model = _nested(model, name)
    return True


def parse_value(text: str) -> Any:
    """A TOML value, or the text itself when it is not one (a bare word)."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``["sft.lora.r=32", "rl.algo=grpo"]`` -> ``{"sft.lora.r": 32, "rl.algo": "grpo"}``;
    one line on a bad item."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise UserError(f"--set {item}: expected KEY=VALUE (e.g. --set sft.lora.r=32)")
        if not is_recipe_key(key):
            raise UserError(f"--set {item}: no recipe setting {key}; `slm-align config "
                            "show` lists every setting")
        overrides[key] = parse_value(text.strip())
    return overrides


def merged_overrides(sets: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    """The ``--set`` overrides with the named flags on top (a flag given wins over
    ``--set`` of the same key)."""
    overrides = parse_sets(sets)
    for key, value in flags.items():
        if value is not None or key not in overrides:
            overrides[key] = value
    return overrides


KTO_ONLY = ("desirable_weight", "undesirable_weight")
"""Preference settings only KTO reads."""
RL_ONLY = ("steps", "prompts_per_step", "group_size", "learning_rate", "epochs", "minibatch_size", "micro_batch_size",
           "clip_eps", "eval_prompts", "report_prompts", "episodes", "max_tool_rounds", "environment",
           "environment_modules")
"""Settings of the ``[rl]`` section that PPO and GRPO read and DPO/KTO do not (they train from preference files
under ``[preference]``)."""
PREFERENCE_TWINS = {"rl.steps": "--pref-steps", "rl.learning_rate": "--pref-lr"}
"""The DPO/KTO flag that means what an RL setting means for PPO and GRPO."""


def _algorithms_of(key: str) -> Optional[tuple[str, ...]]:
    """The algorithms that read a setting (("ppo",), ("grpo",), ("dpo", "kto"), ("kto",)), or
    None for a shared one."""
    names = key.split(".")
    if names[0] == "preference":
        return ("kto",) if names[-1] in KTO_ONLY else ("dpo", "kto")
    if names[0] != "rl" or len(names) < 2:
        return None
    section = None
    if names[1] in RL_SECTIONS:
        section = names[1]
    elif len(names) == 2:
        section = section_of(names[1])
    if section is None and len(names) == 2 and names[1] in RL_ONLY:
        return ("ppo", "grpo")
    return None if section is None else (section,)


def refuse_other_algorithm(algo: str, overrides: dict[str, Any],
                           flag_names: dict[str, str]) -> None:
    """Refuse a setting given on the command line that only another algorithm reads (``--algo ppo
    --beta``, ``--algo dpo --desirable-weight``); ``auto`` (PPO or GRPO, the gate decides)
    accepts both RL sections."""
    for key, value in overrides.items():
        owners = _algorithms_of(key)
        if value is None or owners is None or set(owners) & set(algorithm_candidates(algo)):
            continue
        given = flag_names.get(key, f"--set {key}")
        owner = "/".join(owners)
        twin = ""
        if key in PREFERENCE_TWINS:
            twin = f" ({algo.upper()}'s own: {PREFERENCE_TWINS[key]})"
        raise UserError(f"{given} is a {owner.upper()} setting and --algo is {algo}: drop it or "
                        f"use --algo {owners[0]}{twin}")
