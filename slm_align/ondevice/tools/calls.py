"""The values a tool call passes through: the tool, the call the model asked for, what it produced,
and a reply split into calls.

Stdlib only: this module runs on phones and boards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class Tool:
    """A callable tool: its name, one-line description, JSON schema of its
    arguments, and the function."""

    name: str
    description: str
    parameters: dict
    function: Callable[..., Any]

    def spec(self) -> dict:
        """The OpenAI-style tool dict: ``{"type": "function", "function": {name,
        description, parameters}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description,
                         "parameters": self.parameters},
        }


@dataclass
class ToolCall:
    """One call the model asked for: a registered tool's name and its (not
    yet validated) arguments."""

    name: str
    arguments: dict

    def as_dict(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (the shape
        chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Observation:
    """What a call produced. ``content`` is the text to show the model; on failure
    it starts with "Error:"."""

    name: str
    ok: bool
    content: str
    error: Optional[str] = None

    @classmethod
    def failure(cls, name: str, message: str) -> "Observation":
        """A failed call: the message is both ``error`` and, prefixed with
        "Error: ", ``content``."""
        return cls(name=name, ok=False, content=f"Error: {message}", error=message)

    def as_message(self) -> dict:
        """The observation as a ``{"role": "tool", ...}`` chat message."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass
class ParsedCalls:
    """A reply split into tool calls, the text outside them, and failed calls.

    Each failed call is an ``ok=False`` :class:`Observation` to hand back to the model like a tool's
    result; its ``name`` is the tool name it asked for, or "" when none could be read.
    """

    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    errors: list[Observation] = field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        """True when the reply tried to call a tool, successfully or not."""
        return bool(self.calls or self.errors)


