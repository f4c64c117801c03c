"""The RL algorithms by their ``--algo`` name: the one registry the stage, the pipeline and the
quickstart look an algorithm up in. A new algorithm: its file (a :class:`Learner` subclass that
says what it needs) and its line in :data:`ALGORITHMS`."""

from __future__ import annotations

from slm_align.errors import UserError
from slm_align.rl.grpo import GRPO
from slm_align.rl.learner import Learner
from slm_align.rl.ppo import PPO

ALGORITHMS: dict[str, type[Learner]] = {"ppo": PPO, "grpo": GRPO}
"""Each RL algorithm's learner, by its ``--algo`` name."""


def rl_algorithm(name: str) -> type[Learner]:
    """The learner class of ``name``; a UserError naming the choices for any other name."""
    if name not in ALGORITHMS:
        raise UserError(f"--algo {name} is not an RL algorithm: choose one of "
                        f"{', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
