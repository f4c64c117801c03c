"""What a later stage takes from a run's finished SFT: the recipe it was trained with (model,
seed, data) and its adapter. Read from the SFT manifest, below the stages, so that no stage
imports the SFT stage."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from slm_align.config import Recipe
from slm_align.errors import UserError
from slm_align.runs import WHERE, read_manifest

STAGE = "sft"
"""The SFT stage's folder in a run directory."""


def recorded_data_path(inputs: dict) -> Optional[str]:
    """The corpus path an SFT stage was trained on (None for the demo); a stage recorded before
    :data:`~slm_align.runs.WHERE` keeps it in its data settings."""
    if WHERE in inputs:
        return inputs[WHERE]["data"]
    return inputs["data_settings"].get("path")


def recipe_from_sft(run: Path, recipe: Recipe) -> tuple[Recipe, Path]:
    """The recipe (model, seed, data unless the user names other data) and adapter
    of a run's finished SFT."""
    manifest = read_manifest(Path(run) / STAGE)
    if manifest is None:
        raise UserError(f"run {run} has no finished SFT stage (no sft/manifest.json); run "
                        f"`slm-align sft --out {run}`")
    inputs = manifest["inputs"]
    updated = recipe.model_copy(deep=True)
    updated.model.source = inputs["model"]["ref"]
    updated.seed = inputs["seed"]
    if recipe.data.path is None:  # the run's own corpus and split, unless the user names other data
        updated.data = type(recipe.data).model_validate(dict(inputs["data_settings"],
                                                             path=recorded_data_path(inputs)))
        # RL's task file is not SFT's: the user's choice stands
        updated.data.tasks = recipe.data.tasks
    return updated, Path(run) / STAGE / "adapter"
