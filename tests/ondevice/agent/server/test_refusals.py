"""Validation errors as one-line 400s (server/refusals.py): where, located, validate."""

from __future__ import annotations

from typing import Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field

from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.errors import ApiError
from slm_align.ondevice.agent.server.refusals import located, validate, where


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: str
    content: str = Field(alias="text")


class Body(BaseModel):
    model_config = ConfigDict(strict=True)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    messages: list[Message] = Field(default_factory=list, max_length=2)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        validate(Body, body, Limits())
    return caught.value


@pytest.mark.parametrize("path, text", [
    ((), "the body"),
    (("temperature",), "'temperature'"),
    (("messages", 2, "content"), "messages[2].content"),
    (("messages", 0), "messages[0]"),
])
def test_where_names_the_field(path, text):
    """Top-level fields quoted, nested ones dotted with [index] (mutation: index or dot formatting)."""
    assert where(path) == text


def test_valid_body_is_parsed():
    """A body within bounds comes back as the model (mutation: validate refuses or drops fields)."""
    parsed = validate(Body, {"temperature": 1.5, "messages": [{"role": "user", "text": "hi"}]}, Limits())
    assert parsed.temperature == 1.5
    assert parsed.messages[0].content == "hi"


def test_out_of_range_number_is_a_400_naming_field_range_and_value():
    """The refusal names the field, what it accepts and the value (mutation: the bound or the value left out)."""
    error = refused({"temperature": 3})
    assert error.status == 400
    assert "\n" not in str(error)
    assert str(error) == "'temperature' must be a number from 0 to 2, got 3"


def test_strict_types_refuse_a_bool_for_a_number():
    """A bool is not a number, and the refusal quotes it as JSON (mutation: lax validation)."""
    assert str(refused({"temperature": True})) == "'temperature' must be a number from 0 to 2, got true"


def test_nested_missing_field_is_located_through_lists_and_aliases():
    """A missing aliased field inside a list item is named at its path (mutation: alias or index not followed)."""
    error = refused({"messages": [{"role": "user"}]})
    assert str(error).startswith("messages[0].text is required")


def test_too_many_items_says_count_and_limit():
    """A list past max_length says how many and the limit (mutation: counts left out)."""
    message = {"role": "user", "text": "x"}
    error = refused({"messages": [message] * 3})
    assert str(error) == "'messages' has 3 objects; at most 2 are accepted"


def test_located_stops_at_an_unknown_part():
    """The path goes as far as the model's fields lead (mutation: unknown parts appended)."""
    path, kind = located(Body, ("messages", 1, "nope", "deeper"))
    assert path == ("messages", 1)
    assert kind.annotation is Message
