"""Typed recipe: every setting of every stage, loaded from TOML and overridden by CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import Field, ValidationError

from slm_align.config.base import (
    DEMO,
    ComputeSettings,
    DataSettings,
    HeadroomSettings,
    LoraSettings,
    ModelSettings,
    PairSettings,
    PreferenceSettings,
    RewardSettings,
    SFTSettings,
    Strict,
    TrackingSettings,
    TrainSettings,
)
from slm_align.config.rl import (
    RL_SECTIONS,
    EnvelopeSettings,
    GRPOSettings,
    PPOSettings,
    RLSettings,
    WatchdogSettings,
    section_of,
)
from slm_align.config.tomlcompat import tomllib
from slm_align.errors import UserError

__all__ = ["DEMO", "ComputeSettings", "DataSettings", "EnvelopeSettings", "GRPOSettings",
           "HeadroomSettings", "LoraSettings", "ModelSettings", "PPOSettings", "PairSettings",
           "PreferenceSettings", "RLSettings", "RL_SECTIONS", "Recipe", "RewardSettings",
           "SFTSettings", "TrackingSettings", "TrainSettings", "WatchdogSettings", "load_recipe"]


class Recipe(Strict):
    seed: int = Field(0, description="Seeds the split, the initialisation and the data order.")
    model: ModelSettings = Field(default_factory=ModelSettings,
                                 description="Where the base model comes from.")
    compute: ComputeSettings = Field(default_factory=ComputeSettings,
                                     description="Device, precision, "
                                                                                  "memory savers.")
    data: DataSettings = Field(default_factory=DataSettings,
                               description="The corpus and its split.")
    sft: SFTSettings = Field(default_factory=SFTSettings, description="Supervised fine-tuning.")
    reward: RewardSettings = Field(default_factory=RewardSettings,
                                   description="The Bradley-Terry reward model.")
    headroom: HeadroomSettings = Field(default_factory=HeadroomSettings,
                                       description="The headroom gate.")
    rl: RLSettings = Field(default_factory=RLSettings,
                           description="PPO/GRPO inside the safety envelope.")
    preference: PreferenceSettings = Field(default_factory=PreferenceSettings,
                                           description="DPO/KTO on preference "
                                                       "files, inside the envelope.")
    tracking: TrackingSettings = Field(default_factory=TrackingSettings, description="Experiment "
                                       "tracking (reporting only: no stage's inputs, so it never "
                                       "makes a stage run again).")


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _flat_rl_keys(tree: dict) -> set[str]:
    """The algorithm keys a recipe wrote flat under ``[rl]`` (``rl.beta``):
    errors name them as written."""
    rl = tree.get("rl")
    if not isinstance(rl, dict):
        return set()
    return {key for key in rl if section_of(key) is not None}


def _describe(err: ValidationError, flat: set[str] = frozenset()) -> str:
    """One line naming the first invalid setting as the recipe wrote it, the
    reason and the value given."""
    first = err.errors()[0]
    loc = list(first["loc"])
    if loc[:1] == ["rl"] and len(loc) > 2 and loc[1] in RL_SECTIONS and loc[2] in flat:
        del loc[1]  # written flat (rl.beta), validated in its section (rl.grpo.beta)
    where = ".".join(str(p) for p in loc)
    if isinstance(first.get("input"), dict):
        # a whole section (two spellings of one key): the message says it all
        return f"invalid setting {where}: {first['msg']}"
    return f"invalid setting {where}: {first['msg']} (got {first.get('input')!r})"


def load_recipe(path: Optional[Path] = None, overrides: Optional[dict[str, Any]] = None) -> Recipe:
    """Read a TOML recipe (optional) and apply ``{"sft.learning_rate": 1e-3, ...}``
    overrides (None skipped)."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} not found; pass an existing TOML file")
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        raise UserError(_describe(exc, _flat_rl_keys(tree))) from None
