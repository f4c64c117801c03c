"""A tool's JSON schema from its signature (tools/schema.py)."""

from __future__ import annotations

import enum
from typing import Literal, Optional, Union

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.tools.schema import (
    accepting_enum_values,
    annotation_schema,
    docstring_parts,
    function_schema,
    type_word,
)


class Unit(enum.Enum):
    CELSIUS = "c"
    FAHRENHEIT = "f"


def weather(city: str, days: int = 3, unit: Unit = Unit.CELSIUS, note: Optional[str] = None,
            tags: list[str] = ()) -> str:
    """Forecast for a city.

    Args:
        city: The city's name,
            in English.
        days (int): How many days.

    Returns:
        text
    """
    return f"{city} {days} {unit.value}"


@pytest.mark.parametrize("annotation, schema", [
    (str, {"type": "string"}), (bool, {"type": "boolean"}), (int, {"type": "integer"}),
    (float, {"type": "number"}), (type(None), {"type": "null"}),
    (list[int], {"type": "array", "items": {"type": "integer"}}), (list, {"type": "array"}),
    (dict, {"type": "object"}), (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
    (Optional[int], {"type": ["integer", "null"]}),
    (Union[int, list[str]], {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "string"}}]}),
    (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
    (Literal["a", 1], {"enum": ["a", 1]}),
    (Unit, {"type": "string", "enum": ["c", "f"]}),
])
def test_annotation_schemas(annotation, schema):
    """Each supported annotation maps to its JSON schema (mutation: a branch returning the wrong shape)."""
    assert annotation_schema(annotation) == schema


@pytest.mark.parametrize("annotation, words", [
    (set, "type set is not supported"),
    (dict[int, str], "dictionary keys must be str"),
    (Literal[b"raw"], "choices must be"),
])
def test_unsupported_annotations_are_one_line_refusals(annotation, words):
    """A refusal names where and what to use (mutation: TypeError, or silently {"type": "object"})."""
    with pytest.raises(UserError, match=words) as caught:
        annotation_schema(annotation, "tool 't', parameter 'x'")
    assert str(caught.value).startswith("tool 't', parameter 'x'")
    assert "\n" not in str(caught.value)


def test_function_schema_reads_types_defaults_and_docs():
    """Required = no default; JSON-able defaults shown (an Enum by value); docs joined over lines
    (mutation: defaults missing, continuation line dropped, Returns read as an argument)."""
    summary, schema = function_schema(weather, "weather")
    assert summary == "Forecast for a city."
    assert schema["required"] == ["city"]
    assert schema["additionalProperties"] is False
    props = schema["properties"]
    assert props["city"] == {"type": "string", "description": "The city's name, in English."}
    assert props["days"] == {"type": "integer", "description": "How many days.", "default": 3}
    assert props["unit"]["default"] == "c"
    assert props["note"] == {"type": ["string", "null"], "default": None}
    assert "default" not in props["tags"]


def test_function_schema_refuses_unannotated_and_star_parameters():
    """Mutation: a parameter without a hint given an empty schema; *args accepted."""
    def loose(city):
        return city

    def star(*cities: str):
        return cities

    with pytest.raises(UserError, match="'city' has no type annotation"):
        function_schema(loose, "loose")
    with pytest.raises(UserError, match=r"\*args, \*\*kwargs"):
        function_schema(star, "star")


def test_unresolvable_hint_is_a_user_error():
    """A forward reference that does not resolve is named (mutation: NameError escapes)."""
    def broken(x: "Missing"):  # noqa: F821
        return x

    with pytest.raises(UserError, match="cannot read its type hints"):
        function_schema(broken, "broken")


def test_docstring_parts_ignores_other_sections():
    """Only Args: lines become descriptions (mutation: every indented line taken)."""
    summary, docs = docstring_parts(weather)
    assert summary == "Forecast for a city."
    assert set(docs) == {"city", "days"}


def test_enum_arguments_arrive_as_members():
    """The wrapper turns the JSON value into the Enum member (mutation: raw 'f' passed on)."""
    call = accepting_enum_values(weather)
    assert call(city="Oslo", unit="f") == "Oslo 3 f"

    def plain(x: int) -> int:
        return x
    assert accepting_enum_values(plain) is plain


@pytest.mark.parametrize("schema, word", [
    ({"enum": ["a", 1]}, '"a" | 1'), ({"type": ["string", "null"]}, "string/null"), ({}, "any"),
    ({"type": "integer"}, "integer"),
])
def test_type_word(schema, word):
    """Mutation: enum values not JSON-quoted, or type lists not joined."""
    assert type_word(schema) == word
