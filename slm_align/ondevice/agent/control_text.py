"""Text a user, a client or a model wrote never becomes a control token, wherever
the chat template puts it.

A control token is one the tokenizer makes of its text only when special tokens are parsed
(``<|im_end|>``, ``<|im_start|>``): the template writes them, nobody else may. Message contents are
tokenised on their own without parsing (:mod:`slm_align.ondevice.agent.prompt`); everything else a template
renders from the conversation (a tool's name, description and schema, a past call's arguments, a
tool result's name) and, when the template looks into the contents, the contents too, goes through
:class:`ControlText`: before rendering, each control token's text inside those strings is replaced
by a placeholder (a private-use character pair around its number), and after rendering the
template's text is tokenised with special tokens parsed while each placeholder is tokenised as the
characters it stands for. The model sees the same characters; only their tokens differ, exactly
where a control token would have been. The private-use characters the placeholders and the content
markers use are themselves replaced when typed.

Which tokens are control tokens is asked of the backend's own tokenizer (a string tokenised with and
without parsing special tokens), so it holds for any vocabulary without a list.
"""

from __future__ import annotations

import re
from typing import Any

PLACEHOLDER = "\ue002{}\ue003"
"""Stands for the number-th protected piece of text while the template renders (no
template writes these)."""
PLACEHOLDERS = re.compile("\ue002(\\d+)\ue003")
RESERVED = ("\ue000", "\ue001", "\ue002", "\ue003")
"""The private-use characters of the content markers and the placeholders: typed into text,
they are protected too."""


class ControlText:
    """Protects the strings of one conversation from becoming control tokens; caches
    what it has looked at."""

    def __init__(self, backend):
        self.backend = backend
        self.texts: list[str] = []
        """Placeholder number -> the text it stands for."""
        self._numbers: dict[str, int] = {}
        self._neutral: dict[str, str] = {}
        self._control: dict[int, bool] = {}

    def neutral(self, value: Any) -> Any:
        """``value`` (text, or lists and objects of text, keys included) with every control token's
        text and every reserved character replaced by a placeholder; anything else as it is."""
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, dict):
            return {self.neutral(key): self.neutral(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.neutral(item) for item in value]
        return value

    def tokenize(self, text: str) -> list[int]:
        """Ids of rendered text: the template's own text with special tokens parsed, each
        placeholder as the plain characters it stands for."""
        ids: list[int] = []
        position = 0
        for found in PLACEHOLDERS.finditer(text):
            number = int(found.group(1))
            if number >= len(self.texts):
                continue  # not one of ours (a template cannot write these): tokenised with the text around it
            ids += self._parsed(text[position:found.start()])
            ids += self.backend.tokenize(self.texts[number], add_special=False, special=False)
            position = found.end()
        return ids + self._parsed(text[position:])

    def _parsed(self, text: str) -> list[int]:
        return self.backend.tokenize(text, add_special=False) if text else []

    def _text(self, text: str) -> str:
        if text not in self._neutral:
            pieces = set(self._controls(text)) | {char for char in RESERVED if char in text}
            self._neutral[text] = self._replace(text, pieces) if pieces else text
        return self._neutral[text]

    def _replace(self, text: str, pieces: set[str]) -> str:
        """``text`` with each of ``pieces`` replaced by its placeholder, in one pass
        (longest piece first)."""
        pattern = re.compile("|".join(re.escape(piece) for piece in sorted(pieces, key=len, reverse=True)))
        return pattern.sub(self._placeholder, text)

    def _placeholder(self, found: re.Match) -> str:
        piece = found.group(0)
        if piece not in self._numbers:
            self._numbers[piece] = len(self.texts)
            self.texts.append(piece)
        return PLACEHOLDER.format(self._numbers[piece])

    def _controls(self, text: str) -> list[str]:
        """The texts of the control tokens that ``text`` would hold if
        special tokens were parsed."""
        if not text:
            return []
        parsed = self.backend.tokenize(text, add_special=False)
        plain = set(self.backend.tokenize(text, add_special=False, special=False))
        found = []
        for token in set(parsed) - plain:
            piece = self.backend.detokenize([token])
            if piece and piece in text and self._is_control(token, piece):
                found.append(piece)
        return found

    def _is_control(self, token: int, piece: str) -> bool:
        """Whether ``token`` is made of ``piece`` only when special tokens are parsed."""
        if token not in self._control:
            self._control[token] = (self.backend.tokenize(piece, add_special=False) == [token]
                                    and self.backend.tokenize(piece, add_special=False, special=False) != [token])
        return self._control[token]
