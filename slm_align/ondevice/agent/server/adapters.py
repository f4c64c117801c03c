"""Which LoRA adapters answer a request: named adapter sets picked by the OpenAI ``model`` field
(``serve --adapter NAME=FILE``), and the A/B test of a candidate against the current set
(``serve --candidate FILE``) that promotes or reverts itself on the users' thumbs.

Names: the base's file name is the base alone, each ``--adapter`` NAME its adapters (in order),
``candidate`` the candidate's, and :data:`DEFAULT` (or no ``model`` at all) whatever the server routes
the conversation to: the current set (the first ``--adapter``, else the base) or, for a share of
conversations while the A/B test collects, the candidate. A server with no adapters ignores ``model``, as
it always did; one with adapters refuses an unknown name with a 400 that lists the known ones.

Conversation ids are the server's: a request's ``x_conversation_id`` counts only if this server signed it
(:class:`~slm_align.ondevice.agent.ab_trial.ConversationIds`), else the conversation gets a new id, returned with the
answer. The A/B test (:class:`~slm_align.ondevice.agent.ab_trial.ABTrial`) counts only the turns it routed (``model``
left out or :data:`DEFAULT`), one observation per conversation, at most ``max_per_client`` conversations per
client (a pseudonym of the peer's address); ``model: "candidate"`` is answered but never counted. After each
feedback the server decides again; a decision (promote, revert, keep) is recorded in the store with its
evidence and logged in one line. After promote the candidate is the current set for every conversation;
after revert or keep the current set stays and routing sends the candidate nothing more. A server
restarted with the same two sets resumes the same trial and keeps to its latest decision.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_sequential import Evidence, SequentialTest
from slm_align.ondevice.agent.ab_trial import ABTrial, ConversationIds
from slm_align.ondevice.agent.loading import Model
from slm_align.ondevice.agent.server.errors import bad
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.gguf.adapter_check import chain_digest

DEFAULT = "default"
"""The name that asks for whatever the server routes the conversation to."""
CANDIDATE = "candidate"
"""The candidate's name under an A/B test."""
LOG = logging.getLogger("uvicorn.error")
"""uvicorn's own logger: its lines show wherever the server's do."""

PathLike = Union[str, Path]


@dataclass(frozen=True)
class AdapterSet:
    """Adapters applied to the base together, under one name."""

    name: str
    paths: tuple[Path, ...]
    """In the order applied (none: the base alone)."""
    model_id: str
    """What turns it answers are recorded under: the chain digest of the base and its adapters."""


@dataclass
class Trial:
    """The A/B test between two adapter sets: the store's trial, and the sets its arms name."""

    current: AdapterSet
    """The set serving before the test (stays the arm compared even once the candidate is promoted)."""
    candidate: AdapterSet
    records: ABTrial

    @property
    def state(self) -> str:
        return self.records.state

    def as_dict(self) -> dict:
        """The state for ``GET /v1/ab``."""
        return {"object": "ab_test", "state": self.state, "current": self.current.name,
                "candidate": self.candidate.name, "current_model_id": self.current.model_id,
                "candidate_model_id": self.candidate.model_id, "candidate_share": self.records.share,
                "evidence": self.records.evidence}


class AdapterRouter:
    """The server's adapter sets and which one answers each request; applies it on the model thread."""

    def __init__(self, model: Model, adapters: Optional[Mapping[str, Sequence[PathLike]]] = None,
                 candidate: Sequence[PathLike] = (), candidate_share: float = 0.5,
                 store: Optional[PreferenceStore] = None, test: SequentialTest = SequentialTest()):
        self.model = model
        self.store = store
        adapters = adapters or {}
        self.sets = {model.name: AdapterSet(model.name, (), model.sha256)}
        for name, paths in adapters.items():
            self.sets[name] = self._named(name, paths)
        self.current = self.sets[next(iter(adapters), model.name)]
        self.trial: Optional[Trial] = None
        if candidate:
            self.trial = self._trial(candidate, candidate_share, test)
        self.ids = self.trial.records.ids if self.trial is not None else ConversationIds()
        """Signs the conversation ids the server hands out (the trial's key, kept in the store)."""
        self.applied: Optional[str] = None
        self._lock = threading.Lock()
        if len(self.sets) > 1:
            self.apply(self.current)

    def _named(self, name: str, paths: Sequence[PathLike]) -> AdapterSet:
        """An ``--adapter`` set under a name of its own."""
        if not name or name in (DEFAULT, CANDIDATE, self.model.name) or "=" in name:
            raise UserError(f"adapter name {name!r} is taken or empty; pass --adapter NAME=FILE with a NAME other "
                            f"than {DEFAULT!r}, {CANDIDATE!r} and the base's file name")
        return self._checked(name, paths)

    def _checked(self, name: str, paths: Sequence[PathLike]) -> AdapterSet:
        """An adapter set, each adapter checked against the base (and loaded) now, in one line if not."""
        if not paths:
            raise UserError(f"adapter set {name!r} has no files; pass --adapter {name}=FILE")
        if not hasattr(self.model.backend, "set_adapters"):
            raise UserError("adapters apply to a GGUF base in llama.cpp; this server runs an ONNX export: "
                            "serve the base .gguf")
        applied = self.model.backend.set_adapters([Path(path) for path in paths])
        digest = chain_digest(self.model.sha256, [adapter["sha256"] for adapter in applied])
        return AdapterSet(name, tuple(Path(path) for path in paths), digest)

    def _trial(self, candidate: Sequence[PathLike], share: float, test: SequentialTest) -> Trial:
        """The A/B test of ``candidate`` against the current set, resumed from the store's latest trial."""
        if self.store is None:
            raise UserError("an A/B test decides on the users' thumbs; pass --store FILE with --candidate")
        arm = self._checked(CANDIDATE, candidate)
        if arm.model_id == self.current.model_id:
            raise UserError(f"the candidate is the current adapter set {self.current.name!r}; pass a new adapter")
        self.sets[CANDIDATE] = arm
        trial = Trial(self.current, arm, ABTrial(self.store, self.current.model_id, arm.model_id, share, test))
        self._settle(trial)
        return trial

    # which set answers (in the event loop or a worker thread)
    def conversation(self, conversation_id: Optional[str]) -> str:
        """The request's conversation id if this server signed it, else a new signed one."""
        return self.ids.accept(conversation_id)

    def pick(self, requested: Optional[str], conversation_id: Optional[str] = None) -> AdapterSet:
        """The set named by the request's ``model``, or (omitted, :data:`DEFAULT`, or any name when the
        server has no adapters) the one the conversation is routed to (no conversation: the current
        set); an unknown name is a 400."""
        if len(self.sets) == 1 or requested in (None, DEFAULT):
            return self.route(conversation_id)
        if requested not in self.sets:
            known = ", ".join([DEFAULT, *self.sets])
            raise bad(f"unknown model {requested[:64]!r}; this server serves {known} (leave 'model' out or pass "
                      f"{DEFAULT!r} for the current adapter)")
        return self.sets[requested]

    def routed_arm(self, requested: Optional[str], conversation_id: Optional[str]) -> Optional[str]:
        """The trial's arm for a request it routes ('current' or 'candidate'; None: no trial collecting,
        or the request named its adapter set)."""
        if self.trial is None or (len(self.sets) > 1 and requested not in (None, DEFAULT)):
            return None
        return self.trial.records.arm(conversation_id)

    def route(self, conversation_id: Optional[str]) -> AdapterSet:
        """The current set, or the candidate for its share of conversations while the A/B test collects."""
        with self._lock:
            if self.trial is not None and self.trial.records.arm(conversation_id) == "candidate":
                return self.trial.candidate
            return self.current

    def for_model_id(self, model_id: str) -> AdapterSet:
        """The set that answered under ``model_id`` (the current one if none of them did)."""
        return next((found for found in self.sets.values() if found.model_id == model_id), self.current)

    # on the model thread
    def apply(self, chosen: AdapterSet) -> None:
        """Put ``chosen``'s adapters on the base unless they are on it already (the base stays loaded)."""
        if len(self.sets) > 1 and self.applied != chosen.name:
            self.model.backend.set_adapters(list(chosen.paths))
            self.applied = chosen.name

    # the A/B test (after each answer and feedback, on a worker thread)
    def record(self, turn_id: Optional[int], arm: Optional[str], client: str) -> None:
        """Name an answered turn as routed by the trial (``client``: the peer's address, kept as a pseudonym)."""
        if self.trial is not None:
            self.trial.records.record(turn_id, arm, self.trial.records.ids.pseudonym(client))

    def evaluate(self) -> Optional[Evidence]:
        """Decide again on the trial's observations; a new decision is logged and acted on. Returns
        the evidence (None without an A/B test still collecting)."""
        trial = self.trial
        if trial is None:
            return None
        evidence = trial.records.evaluate()
        if evidence is None or evidence.decision == "collecting":
            return evidence
        with self._lock:
            self._settle(trial)
        LOG.info("A/B test: %s the candidate (%s) against %r: %d conversations from %d clients, candidate %d/%d "
                 "up, current %d/%d up, discordant pairs won %d to %d", evidence.decision,
                 trial.candidate.model_id[:12], trial.current.name, evidence.conversations, evidence.clients,
                 evidence.candidate_up, evidence.candidate_rated, evidence.current_up, evidence.current_rated,
                 evidence.candidate_wins, evidence.current_wins)
        return evidence

    def _settle(self, trial: Trial) -> None:
        """Act on a decision: after promote the candidate serves everyone; otherwise the current set stays."""
        if trial.state == "promote":
            self.current = trial.candidate
