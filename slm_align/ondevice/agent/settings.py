"""The runtime's settings, typed once: the runtime's :class:`SamplingParams`, each sampling
setting's bounds and help, and the parameter objects an agent is made with (:class:`ChatSettings`,
how it converses; :class:`Recording`, where its turns go).

Each setting a person or a client may choose is an ``Annotated`` type that carries its bounds and
description (:data:`Temperature`, :data:`TopP`, ...). The server's request bodies declare their
fields with these types, and `slm-align chat` makes its flags from :class:`Sampling`'s fields (help,
default and bounds), so each bound is written once, the command line and the server refuse the same
values, and their refusals say it in the same words (:mod:`slm_align.ondevice.agent.bounds`).
``chat --temperature 3`` and a request with ``"temperature": 3`` are both refused with "a number
from 0 to 2".

Pydantic and the standard library only: the command line reads this module when it
starts, and it imports no numpy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Any, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from slm_align.errors import UserError

PENALTY_WINDOW = 64
"""Generated tokens the repetition penalties look back over (llama-cpp-python's
``last_n_tokens_size``)."""


@dataclass
class SamplingParams:
    """How the next token is chosen. ``temperature`` 0 is greedy and identical on both backends."""

    temperature: float = 0.7
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 0.95
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this."""
    top_k: int = 40
    """Keep only the k most likely tokens (0: all)."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one's probability (0: off)."""
    repeat_penalty: float = 1.0
    """Divide the (positive) logits of recently generated tokens by this (1: off; 1.1-1.3
    stops tiny models looping)."""
    frequency_penalty: float = 0.0
    """Subtract this times a token's count among recent tokens from its logit
    (OpenAI's frequency_penalty)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token among recent tokens
    (OpenAI's presence_penalty)."""
    max_tokens: int = 256
    """Most tokens one reply may have."""
    stop: list = field(default_factory=list)
    """Strings that end the reply (not included in it)."""
    seed: int = 0
    """Seed of the sampler, so a reply can be reproduced."""
    call_threshold: Optional[float] = None
    """The call rule (:mod:`~slm_align.ondevice.agent.call_rule`): on a round that may call a tool, call
    exactly when the model's probability of opening a call is at least this (None: the sampler alone
    decides, greedy by the single likeliest token; 0.5: by the larger mass)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def penalized(self) -> bool:
        """Any repetition penalty is on."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def check_call_threshold(value) -> None:
    """Refuse a call threshold that is not a number from 0 to 1, in one line naming the flag."""
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and 0 <= value <= 1):
        raise UserError(f"--call-threshold must be a number from 0 to 1 (call when the model's probability of "
                        f"opening a call is at least this), got {value}")


DEFAULTS = SamplingParams()
"""The runtime's defaults: those of every sampling flag and of every request field left out."""

Number = Union[StrictInt, StrictFloat]
"""A JSON number (integer or not), never a bool or a numeric string."""
Temperature = Annotated[Number, Field(ge=0, le=2, description="Sampling temperature (0: greedy).")]
TopP = Annotated[Number, Field(ge=0, le=1, description="Nucleus sampling: keep the likeliest "
                                                      "tokens whose probabilities add up to this.")]
TopK = Annotated[StrictInt, Field(ge=0, description="Sample from the k likeliest tokens only (0: all).")]
MinP = Annotated[Number, Field(ge=0, le=1, description="Drop tokens less likely than this fraction "
                                                      "of the likeliest one's "
                                                      "probability (0: off; try 0.05).")]
RepeatPenalty = Annotated[Number, Field(ge=1, le=2, description=(
    f"Penalise the last {PENALTY_WINDOW} generated tokens, llama.cpp's repetition penalty (1: off; 1.1-1.5 stops "
    "tiny models looping)."))]
FrequencyPenalty = Annotated[Number, Field(ge=-2, le=2, description=(
    f"Subtract this times a token's count among the last {PENALTY_WINDOW} generated tokens from its logit "
    "(OpenAI's frequency_penalty; 0: off)."))]
PresencePenalty = Annotated[Number, Field(ge=-2, le=2, description=(
    f"Subtract this from the logit of each token among the last {PENALTY_WINDOW} generated tokens (OpenAI's "
    "presence_penalty; 0: off)."))]
MaxTokens = Annotated[StrictInt, Field(ge=1, description="Most tokens per answer.")]
Seed = Annotated[StrictInt, Field(description="Sampling seed: the same seed, the same answer.")]


class Sampling(BaseModel):
    """The sampling settings `slm-align chat` takes as flags; a served request sends the same
    fields, of the same types (and ``max_tokens`` within the server's limit)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    temperature: Temperature = DEFAULTS.temperature
    top_p: TopP = DEFAULTS.top_p
    top_k: TopK = DEFAULTS.top_k
    min_p: MinP = DEFAULTS.min_p
    repeat_penalty: RepeatPenalty = DEFAULTS.repeat_penalty
    frequency_penalty: FrequencyPenalty = DEFAULTS.frequency_penalty
    presence_penalty: PresencePenalty = DEFAULTS.presence_penalty
    max_tokens: MaxTokens = DEFAULTS.max_tokens
    seed: Seed = DEFAULTS.seed

    def params(self) -> SamplingParams:
        """These settings as the runtime takes them."""
        return SamplingParams(**self.model_dump())


@dataclass(frozen=True)
class ChatSettings:
    """How an agent converses (:class:`~slm_align.ondevice.agent.runtime.Agent`)."""

    system: Optional[str] = None
    """The system prompt (none: no system message)."""
    sampling: Optional[SamplingParams] = None
    """How each token is chosen (none: :data:`DEFAULTS`)."""
    max_tool_rounds: int = 4
    """Tool rounds an answer may take before the final one."""
    grammar: bool = True
    """Constrain a tool call to the tools' GBNF grammar (GGUF models: llama.cpp samples under
    it)."""
    answer_grammar: Optional[str] = None
    """A llama.cpp grammar the final answer follows (see
    :mod:`slm_align.ondevice.agent.constrain`)."""
    logprobs: Optional[int] = None
    """Record each answer token's log-probability and this many likeliest alternatives (None:
    don't)."""
    describe_tools: bool = False
    """Write the tools into the system message when the chat template drops them (the runtime's
    fallback, :func:`~slm_align.ondevice.templates.chat.tools_system_text`, as SFT chats and task
    prompts render them: RL's episodes and evaluate-agent turn it on); off, the template's rendering
    alone (``chat`` and ``serve``, whose clients may send more tools than a small context holds)."""


@dataclass(frozen=True)
class Recording:
    """Where an agent's turns are recorded, and whether its user agreed to train on them."""

    store: Any = None
    """A :class:`~slm_align.ondevice.agent.store.PreferenceStore` (``Agent.load`` and ``serve`` also
    take its path); None records nothing."""
    consent: bool = False
    """Mark recorded turns as consented for training."""


Settings = TypeVar("Settings")


def take_options(settings: Settings, options: dict) -> Settings:
    """``settings`` (a dataclass) with the fields named in ``options`` replaced, those taken out of
    ``options``: the keyword shorthand ``Agent(..., sampling=..., store=...)`` for the objects."""
    names = {item.name for item in fields(settings)}
    chosen = {name: options.pop(name) for name in list(options) if name in names}
    return replace(settings, **chosen) if chosen else settings


def refuse_unknown(caller: str, options: dict) -> None:
    """A keyword no settings object took is a TypeError, as Python's own for an unknown keyword."""
    if options:
        raise TypeError(f"{caller}() got an unexpected keyword argument {next(iter(options))!r}")
