"""One A/B trial of a candidate adapter against the current one, as a server and a device run it:
the conversation ids it hands out (signed), which arm each conversation goes to, the turns it
routed, and its decision (recorded in the store, with its evidence).

Conversation ids are ``NONCE.MAC``: a random nonce and an HMAC-SHA256 of it under the trial's key
(kept in the store, never sent). An id that does not verify was not handed out by this trial: it
gets a new one, so a client cannot choose ids, and the arm is a keyed hash of the nonce
(``HMAC(key, "arm:" + nonce)``), which a client cannot compute. Only turns the trial routed count,
each conversation's first verdict once (see :mod:`slm_align.ondevice.agent.ab_sequential`); a turn
asked of an arm by name is answered but never recorded as routed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_sequential import Evidence, SequentialTest, decide
from slm_align.ondevice.gguf.adapter_check import chain_digest

MAC_CHARS = 32
"""Hex digits of the MAC in a conversation id (128 bits)."""
NONCE_BYTES = 12


def check_share(share: float) -> float:
    """The candidate's share of conversations: above 0 and below 1 (else neither arm gets
    ratings)."""
    if not 0 < share < 1:
        raise UserError(f"--candidate-share {share}: must be above 0 and below 1 (0.5: half the conversations)")
    return share


class ConversationIds:
    """Conversation ids signed under a key: handed out, checked, and hashed into a share."""

    def __init__(self, key: Optional[bytes] = None):
        self.key = key or secrets.token_bytes(32)

    def _mac(self, what: str) -> str:
        return hmac.new(self.key, what.encode("utf-8"), hashlib.sha256).hexdigest()

    def new(self) -> str:
        """A fresh id, signed."""
        nonce = secrets.token_hex(NONCE_BYTES)
        return f"{nonce}.{self._mac(nonce)[:MAC_CHARS]}"

    def verified(self, conversation_id: Optional[str]) -> bool:
        """Whether this key signed ``conversation_id``."""
        if not isinstance(conversation_id, str) or conversation_id.count(".") != 1:
            return False
        nonce, mac = conversation_id.split(".")
        return hmac.compare_digest(self._mac(nonce)[:MAC_CHARS], mac)

    def accept(self, conversation_id: Optional[str]) -> str:
        """``conversation_id`` if this key signed it, else a new id."""
        return conversation_id if self.verified(conversation_id) else self.new()

    def fraction(self, conversation_id: str) -> float:
        """A uniform number in [0, 1) that only the key's holder can compute from the id."""
        return int(self._mac("arm:" + conversation_id.split(".")[0])[:16], 16) / 16 ** 16

    def pseudonym(self, client: str) -> str:
        """A stable name for a client (an address) that does not reveal it."""
        return self._mac("client:" + client)[:16]


class ABTrial:
    """The trial between two model ids in a store: collecting until its first decision, then that
    one."""

    def __init__(self, store, current_id: str, candidate_id: str, share: float = 0.5,
                 test: SequentialTest = SequentialTest()):
        if store is None:
            raise UserError("an A/B test decides on the users' thumbs; pass a preference store (--store FILE) "
                            "with the candidate")
        if current_id == candidate_id:
            raise UserError("the candidate is the current adapter set; pass a new adapter")
        self.store = store
        self.current_id, self.candidate_id = current_id, candidate_id
        self.share = check_share(share)
        self.test = test
        row = store.open_trial(current_id, candidate_id, share)
        self.id = row["id"]
        self.ids = ConversationIds(bytes.fromhex(row["key"]))
        self.state = "collecting"
        self.evidence: Optional[dict] = None
        earlier = store.decisions(current_id, candidate_id)
        if earlier:
            self.state, self.evidence = earlier[-1]["decision"], earlier[-1]["evidence"]
        self._lock = threading.Lock()

    def arm(self, conversation_id: str) -> Optional[str]:
        """'candidate' or 'current' for a conversation this trial signed while it collects (None
        after a decision, or for an id it did not sign)."""
        if self.state != "collecting" or not self.ids.verified(conversation_id):
            return None
        return "candidate" if self.ids.fraction(conversation_id) < self.share else "current"

    def record(self, turn_id: Optional[int], arm: Optional[str], client: str) -> None:
        """Name a turn as routed to ``arm`` (nothing without a turn or an arm, or once decided)."""
        if turn_id is not None and arm is not None and self.state == "collecting":
            self.store.record_routed(turn_id, self.id, arm, client)

    def evaluate(self) -> Optional[Evidence]:
        """Decide again on the trial's observations: the evidence (a new decision is recorded in the
        store); None once decided (by this call's rival too)."""
        if self.state != "collecting":
            return None
        evidence = decide(self.store.trial_observations(self.id), self.test)
        with self._lock:
            if self.state != "collecting":  # another verdict decided meanwhile
                return None
            self.evidence = evidence.to_dict()
            if evidence.decision != "collecting":
                self.store.record_decision(self.current_id, self.candidate_id, evidence.decision, self.evidence)
                self.state = evidence.decision
        return evidence


@dataclass(frozen=True)
class Candidate:
    """Adapters A/B-tested on a device against the current ones, and how the trial runs."""

    adapters: tuple[Union[str, Path], ...]
    """The candidate's LoRA adapter GGUFs, applied to the base in order."""
    share: float = 0.5
    """The share of new conversations routed to the candidate while the trial collects."""
    test: SequentialTest = SequentialTest()
    """The sequential test's settings."""
    client: Optional[str] = None
    """The app's user (capped as one client); None: each conversation is its own."""


class DeviceRouter:
    """The embedded runtime's side of a trial (``Agent.load(base, adapters=..., candidate=...)``):
    each new conversation gets a signed id and its arm's adapters, each recorded turn is named as
    routed, and each thumbs lets the trial decide again, in the device's store as ``serve`` does.
    The client is the app's ``client`` (its user), else each conversation its own: the owner of a
    device is not capped against themselves; a fleet decision (``feedback ab``) caps each device
    instead."""

    def __init__(self, agent, current: Sequence, candidate: Candidate):
        if not candidate.adapters:
            raise UserError("an A/B test needs a candidate: pass candidate=[adapter GGUF, ...]")
        self.paths = {"current": list(current), "candidate": list(candidate.adapters)}
        candidate_id = self._model_id(agent, self.paths["candidate"])
        # the current set applied last: it serves until a conversation is routed
        current_id = self._model_id(agent, self.paths["current"])
        self.trial = ABTrial(agent.store, current_id, candidate_id, candidate.share, candidate.test)
        self.client = candidate.client
        self.arm: Optional[str] = None
        """The arm of the conversation going on (None: not routed by the trial)."""

    @staticmethod
    def _model_id(agent, paths: list) -> str:
        applied = agent.set_adapters(paths)
        return chain_digest(agent.base_id, [adapter["sha256"] for adapter in applied])

    def enter(self, agent, conversation_id: str) -> str:
        """Route the conversation (a new or a restored one): its arm's adapters go on the base."""
        self.arm = self.trial.arm(conversation_id)
        promoted = self.trial.state == "promote"
        agent.set_adapters(self.paths["candidate" if self.arm == "candidate" or promoted else "current"])
        return conversation_id

    def begin(self, agent) -> str:
        """A new conversation: its signed id, routed."""
        return self.enter(agent, self.trial.ids.new())

    def recorded(self, agent, turn_id: Optional[int]) -> None:
        self.trial.record(turn_id, self.arm, self.client or agent.conversation_id)

    def evaluate(self) -> Optional[Evidence]:
        return self.trial.evaluate()
