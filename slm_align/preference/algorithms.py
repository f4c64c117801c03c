"""The preference algorithms by name, and the learner the stage builds for one."""

from __future__ import annotations

from slm_align.config import EnvelopeSettings, PreferenceSettings
from slm_align.preference.data import PreferenceData
from slm_align.preference.dpo import DPO
from slm_align.preference.kto import KTO
from slm_align.preference.learner import PreferenceLearner

ALGORITHMS: dict[str, type[PreferenceLearner]] = {"dpo": DPO, "kto": KTO}
"""Each preference algorithm's learner, by its ``--algo`` name."""


def preference_learner(policy, tokenizer, data: PreferenceData, settings: PreferenceSettings,
                       algo: str, envelope: EnvelopeSettings, seed: int, max_length: int,
                       precision: str = "fp32", checkpointing: bool = False) -> PreferenceLearner:
    """The :data:`ALGORITHMS` learner of ``algo`` ("dpo" or "kto"), built with the other arguments
    (each learner class takes them in this order)."""
    learner = ALGORITHMS[algo]
    return learner(policy, tokenizer, data, settings, envelope, seed, max_length, precision,
                   checkpointing)
