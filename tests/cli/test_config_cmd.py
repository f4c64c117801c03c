"""``config show``'s pieces (cli/config_cmd.py): settings walked in TOML order, values as TOML writes them."""

from __future__ import annotations

from typing import Optional

import pytest
from pydantic import BaseModel, Field

from slm_align.cli.config_cmd import _line, settings_of, toml_value
from slm_align.config.tomlcompat import tomllib


class Inner(BaseModel):
    r: int = Field(16, description="Rank.")


class Outer(BaseModel):
    inner: Inner = Field(default_factory=Inner)
    name: Optional[str] = Field(None, description="A name.")
    rate: float = Field(0.5, description="A rate.")


def test_settings_walk_own_fields_before_sections():
    """A section's leaves come before its sub-tables, keys dotted (mutation: declaration order kept,
    which would put a key after its [table] in TOML)."""
    settings = list(settings_of(Outer(inner=Inner(r=32), rate=1.0), Outer()))
    assert [s["key"] for s in settings] == ["name", "rate", "inner.r"]
    assert settings[2] == {"key": "inner.r", "value": 32, "default": 16, "doc": "Rank."}
    assert settings[1]["value"] == 1.0 and settings[1]["default"] == 0.5


@pytest.mark.parametrize("value, text", [
    (True, "true"), (None, "null"), ("a\"b", '"a\\"b"'), (["a", 2], '["a", 2]'),
    ({"a": 1.0, "b": [True]}, "{ a = 1.0, b = [true] }"), ((1, 2), "[1, 2]"),
])
def test_toml_value(value, text):
    """Mutation: Python reprs (True, 'a') instead of TOML's."""
    assert toml_value(value) == text


def test_toml_values_load_back():
    """What toml_value writes, tomllib reads as the same value (mutation: quoting that TOML rejects)."""
    value = {"path": "C:\\dir\\x", "items": ["é", 3], "on": False}
    assert tomllib.loads(f"x = {toml_value(value)}")["x"] == value


def test_line_comments_out_unset_settings():
    """A None value is commented out since TOML has no null; the default shown (mutation: 'name = null')."""
    assert _line({"key": "a.name", "value": None, "default": None, "doc": "A name."}) == (
        "# name = (unset)  # A name. (default: unset)")
    assert _line({"key": "a.r", "value": 32, "default": 16, "doc": "Rank."}) == "r = 32  # Rank. (default: 16)"
