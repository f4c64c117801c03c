"""The final answer a user sees when the model still asks for a tool with no tool round left
(:func:`user_answer`): never the call's raw text.

Stdlib only: this module runs on phones and boards.
"""

from __future__ import annotations

UNANSWERED = "I could not get this done with my tools."
"""Said in place of a call the runtime will not run (no tool round left): a user never reads raw
call text."""


def user_answer(text: str, parsed) -> str:
    """The final answer as the user sees it: ``text`` as written, unless ``parsed``
    (:class:`~slm_align.ondevice.tools.calls.ParsedCalls` of ``text``) asks for a tool when no round is
    left; then the text outside its calls followed by :data:`UNANSWERED`, never the call itself."""
    if not parsed.wants_tools:
        return text
    return " ".join(part for part in (parsed.text.strip(), UNANSWERED) if part)
