"""How evaluation episodes run (:class:`EpisodeSettings`): greedy or sampled, how long, how many
tool rounds, how many decoded together; their bounds (:func:`check_settings`) and what the report
says about them (:meth:`EpisodeSettings.report`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slm_align.errors import UserError
from slm_align.ondevice.agent.bounds import accepted, bounds, typed
from slm_align.ondevice.agent.settings import Temperature, check_call_threshold
from slm_align.ondevice.agent.task_batch import DEFAULT_BATCH

DEFAULT_MAX_TOKENS = 96
DEFAULT_TOOL_ROUNDS = 3
DEFAULT_SAMPLES = 1
"""1: one greedy episode per task."""
DEFAULT_TEMPERATURE = 0.7
"""The temperature of sampled episodes (``samples`` > 1)."""
TEMPERATURE = typed(Temperature)
"""The runtime's bounds on a temperature (0 to 2), as `chat` and the server apply them."""
TEMPERATURE_LIMITS = bounds(TEMPERATURE.metadata)
TEMPERATURE_ACCEPTED = accepted(TEMPERATURE.annotation, TEMPERATURE.metadata)
INTERVALS = {
    "success_ci95": "Wilson score interval (95%) of the successes over the episodes",
    "pass_at_1_ci95": "percentile bootstrap (95%, 2000 resamples) over tasks of each task's c/n",
    "pass_at_k_ci95": "percentile bootstrap (95%, 2000 resamples) over tasks of each task's pass@k",
    "comparisons.ci95": "paired percentile bootstrap (95%, 2000 resamples) over tasks of the "
                        "difference in each task's success rate",
}
"""How each interval of the report is computed (the report carries this)."""


def _integer(value, least: int) -> bool:
    """``value`` is an integer (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _temperature(value) -> bool:
    """``value`` is a number within the runtime's temperature bounds."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and TEMPERATURE_LIMITS["ge"] <= value <= TEMPERATURE_LIMITS["le"]


def check_settings(samples: int, temperature: float, max_tool_rounds: int, max_tokens: int,
                   batch: int = 1, call_threshold: Optional[float] = None) -> None:
    """Refuse a setting out of its bounds, in one line naming the flag and what it accepts."""
    if not _integer(samples, 1):
        raise UserError(f"--samples must be an integer >= 1 (episodes per task; 1 answers "
                        f"greedily), got {samples}")
    if not _temperature(temperature):
        raise UserError(f"--temperature must be {TEMPERATURE_ACCEPTED}, got {temperature}")
    if not _integer(max_tool_rounds, 0):
        raise UserError(f"--max-tool-rounds must be an integer >= 0 (tool rounds before the final "
                        f"answer), got {max_tool_rounds}")
    if not _integer(max_tokens, 1):
        raise UserError(f"--max-new-tokens must be an integer >= 1, got {max_tokens}")
    if not _integer(batch, 1):
        raise UserError(f"--batch must be an integer >= 1 (episodes decoded together), got {batch}")
    check_call_threshold(call_threshold)


@dataclass(frozen=True)
class EpisodeSettings:
    """How each artifact's evaluation episodes run."""

    samples: int = DEFAULT_SAMPLES
    """Episodes per task: 1 answers greedily, more are sampled at ``temperature``."""
    temperature: float = DEFAULT_TEMPERATURE
    """The temperature of sampled episodes (unused when greedy)."""
    seed: int = 0
    """Seeds each sampled episode (:func:`~slm_align.ondevice.agent.task_eval.sample_seed`) and the
    bootstrap intervals."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """Most tokens per model reply."""
    max_tool_rounds: int = DEFAULT_TOOL_ROUNDS
    """Tool rounds an episode may take before its final answer."""
    batch: int = DEFAULT_BATCH
    """A GGUF model's episodes decoded together (ONNX: one at a time); the results do not change."""
    threads: Optional[int] = None
    """Each backend's CPU threads (None:
    :func:`~slm_align.ondevice.devices.host.default_threads`)."""
    call_threshold: Optional[float] = None
    """The call rule: a reply calls a tool exactly when the model's probability of opening a call is at
    least this (None: off, greedy decides by the likeliest token; see
    :mod:`~slm_align.ondevice.agent.call_rule`)."""
    chat_template: Optional[str] = None
    """A chat template in place of every artifact's own ("chatml" or a Jinja file): a base model that
    ships none is judged with the template its tuned versions were trained with (None: each its own)."""

    def check(self) -> None:
        """One line for the first setting out of its bounds (:func:`check_settings`)."""
        check_settings(self.samples, self.temperature, self.max_tool_rounds, self.max_tokens,
                       self.batch, self.call_threshold)

    def report(self) -> dict:
        """How the episodes ran, for the report: greedy or sampled, the temperature (0 when
        greedy), the seed, and how each interval is computed."""
        greedy = self.samples == 1
        return {"samples": self.samples, "decoding": "greedy" if greedy else "sampled",
                "temperature": 0.0 if greedy else self.temperature, "seed": self.seed,
                "call_threshold": self.call_threshold, "chat_template": self.chat_template,
                "intervals": dict(INTERVALS)}
