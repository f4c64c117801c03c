"""The bodies of ``/v1/feedback`` (a verdict on a recorded turn) and ``/v1/alternative``
(a second answer to it)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, Field, StrictInt, StrictStr, ValidationInfo
from pydantic_core import PydanticCustomError

from slm_align.ondevice.agent.server.body import Body, message_sized
from slm_align.ondevice.agent.store import FEEDBACK_KINDS, MAX_TURN_ID, PREFERRED


def _required_for(kind: str):
    """An after-validator: the text must be non-empty when the verdict's kind is ``kind``."""
    def check(text: Optional[str], info: ValidationInfo) -> Optional[str]:
        if info.data.get("kind") == kind and not (text or "").strip():
            raise PydanticCustomError("required_for", 'is required when "kind" is '
                                                      '"{kind}": non-empty text',
                                      {"kind": kind})
        return text
    return AfterValidator(check)


TurnId = Annotated[StrictInt, Field(ge=1, le=MAX_TURN_ID, description="the x_turn_id of the answer")]
TurnToken = Annotated[StrictStr, Field(min_length=1, max_length=128, description="the x_turn_token of the answer")]


class FeedbackBody(Body):
    """A verdict on a recorded turn, as the page and API clients send it."""

    kind: Literal[FEEDBACK_KINDS]
    """up, down, choice or edit."""
    preferred: Literal[PREFERRED] = "this"
    """choice: which answer won, 'this' (the turn's) or 'other'."""
    turn_id: TurnId
    turn_token: TurnToken
    text: Annotated[Optional[StrictStr], _required_for("edit"), AfterValidator(message_sized)] = \
        Field(None, validate_default=True)
    """edit: the corrected answer."""
    other: Annotated[Optional[StrictStr], _required_for("choice"), AfterValidator(message_sized)] = \
        Field(None, validate_default=True)
    """choice: the other candidate (from /v1/alternative)."""


class AlternativeBody(Body):
    """A request for a second answer to a recorded turn's prompt."""

    turn_id: TurnId
    turn_token: TurnToken
    seed: Optional[StrictInt] = None
    """The candidate's seed (default: the turn's seed + 1)."""
