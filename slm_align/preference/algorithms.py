"""The preference algorithms by their ``--algo`` name: the one registry the stage and the
pipeline look an algorithm up in. A new algorithm: its file (a :class:`PreferenceLearner`
subclass that says what it trains on and measures) and its line in :data:`ALGORITHMS`."""

from __future__ import annotations

from slm_align.errors import UserError
from slm_align.preference.dpo import DPO
from slm_align.preference.kto import KTO
from slm_align.preference.learner import PreferenceLearner

ALGORITHMS: dict[str, type[PreferenceLearner]] = {"dpo": DPO, "kto": KTO}
"""Each preference algorithm's learner, by its ``--algo`` name."""


def trains_on_preferences(name: str) -> bool:
    """Whether ``--algo name`` is a preference algorithm (trained on preference files, no
    sampling) rather than RL."""
    return name in ALGORITHMS


def preference_algorithm(name: str) -> type[PreferenceLearner]:
    """The learner class of ``name``; a UserError naming the choices for any other name."""
    if not trains_on_preferences(name):
        raise UserError(f"--algo {name} is not a preference algorithm: choose one of "
                        f"{', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
