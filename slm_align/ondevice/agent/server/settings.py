"""What a served app is made with, grouped
(:func:`~slm_align.ondevice.agent.server.app.create_app`): how the model opens, who may call, what
the server does with each answer, and which adapters answer. The request limits are
:class:`~slm_align.ondevice.agent.server.body.Limits`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from slm_align.ondevice.agent.ab_sequential import SequentialTest
from slm_align.ondevice.agent.server.service import DEFAULT_BATCH

PathLike = Union[str, Path]


@dataclass(frozen=True)
class Opening:
    """How the model is loaded, as for ``Agent.load``."""

    device: Optional[str] = None
    """A device profile that sets threads and context."""
    threads: Optional[int] = None
    """CPU threads of the backend (None: the profile's, else the host's default)."""
    n_ctx: Optional[int] = None
    """The context window (None: the profile's, else the runtime's default)."""
    chat_template: Optional[str] = None
    """"chatml" or a Jinja file in place of the model's own (base models have none; without one,
    chat requests are refused and /v1/completions still continues plain text)."""


@dataclass(frozen=True)
class Access:
    """Who may call the server."""

    api_key: Optional[str] = None
    """When set, every /v1 route needs ``Authorization: Bearer <api_key>``."""
    allowed_hosts: Sequence[str] = ()
    """Host names accepted besides loopback ones when no ``api_key`` is set (``*``: any); see
    :mod:`slm_align.ondevice.agent.server.guard`."""


@dataclass(frozen=True)
class Answering:
    """What the server does with requests: where turns are recorded, which tools run, how many
    requests decode together."""

    store_path: Optional[PathLike] = None
    """Preference database to record turns and feedback in (None: record nothing)."""
    consent: bool = False
    """Mark recorded turns as consented for training."""
    tools: bool = False
    """Run the built-in tools (calculator, clock, and notes in ``notes``) on the server."""
    notes: Optional[PathLike] = None
    """Folder the notes tools may use (with ``tools``)."""
    batch: int = DEFAULT_BATCH
    """Requests of a GGUF model decoded together (one llama.cpp context, a sequence each; 1: one at
    a time on one model thread, as ONNX models and adapter sets always are)."""
    call_threshold: Optional[float] = None
    """The call rule on replies that may call a tool: call exactly when the model's probability of
    opening a call is at least this (None: off; see :mod:`~slm_align.ondevice.agent.call_rule`)."""


@dataclass(frozen=True)
class Routing:
    """Which LoRA adapters answer (see :mod:`slm_align.ondevice.agent.server.adapters`)."""

    adapters: Optional[Mapping[str, Sequence[PathLike]]] = None
    """Named adapter sets for a GGUF base, ``{name: [adapter GGUFs in order]}``, picked by a
    request's ``model``; the first is the current one."""
    candidate: Union[PathLike, Sequence[PathLike], None] = None
    """An adapter GGUF (or a list, applied in order) A/B-tested against the current set on the
    users' thumbs (needs a store)."""
    candidate_share: float = 0.5
    """The share of conversations the candidate gets while the test collects."""
    ab_test: SequentialTest = SequentialTest()
    """The sequential test's settings."""

    def candidates(self) -> list:
        """The candidate's adapters as a list (one path or several)."""
        if isinstance(self.candidate, (str, Path)):
            return [self.candidate]
        return list(self.candidate or ())
