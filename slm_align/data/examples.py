"""The unit of data: one document, a prompt/completion pair, or a chat."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Example:
    """One training item. Exactly one shape: ``text``; ``prompt`` +
    ``completion``; or chat ``messages``."""

    text: Optional[str] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None
    messages: Optional[tuple[dict, ...]] = None
    """A chat in OpenAI's form: ``role`` and ``content``, and where given an assistant's
    ``tool_calls`` and a tool message's ``name`` and ``tool_call_id``."""
    tools: Optional[tuple[dict, ...]] = None
    """The tools a chat offers (OpenAI function schemas), rendered by templates that show them."""

    def key(self) -> str:
        """Canonical form: two examples with the same key are the same item (used
        to split without leaks)."""
        if self.messages is not None:
            plain = [[m["role"], m["content"]] for m in self.messages]
            if self.tools is None and all(set(m) == {"role", "content"} for m in self.messages):
                return json.dumps(plain)  # a plain chat keeps the key (and the split) it always had
            return json.dumps([self.messages, self.tools], sort_keys=True)
        if self.prompt is not None:
            return json.dumps([self.prompt, self.completion])
        return " ".join((self.text or "").split())
