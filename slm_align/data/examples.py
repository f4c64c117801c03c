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
    messages: Optional[tuple[tuple[str, str], ...]] = None

    def key(self) -> str:
        """Canonical form: two examples with the same key are the same item (used
        to split without leaks)."""
        if self.messages is not None:
            return json.dumps(self.messages)
        if self.prompt is not None:
            return json.dumps([self.prompt, self.completion])
        return " ".join((self.text or "").split())
