"""ControlText: text from users and tools never becomes a control token (unit tests with a toy tokenizer)."""

from __future__ import annotations

from slm_align.ondevice.agent.control_text import PLACEHOLDER, ControlText

CONTROLS = {"<|im_end|>": 1000, "<|im_start|>": 1001}
"""Control tokens of the toy vocabulary: made of their text only when special tokens are parsed."""
WORD = {"<b>": 2000}
"""An ordinary added token: made of its text whether or not special tokens are parsed."""


class ToyBackend:
    """Characters are their code points; control texts become one id only with ``special`` on."""

    def __init__(self):
        self.calls = 0

    def tokenize(self, text, add_special=False, special=True):
        self.calls += 1
        ids, position = [], 0
        pieces = {**WORD, **(CONTROLS if special else {})}
        while position < len(text):
            for piece, token in pieces.items():
                if text.startswith(piece, position):
                    ids.append(token)
                    position += len(piece)
                    break
            else:
                ids.append(ord(text[position]))
                position += 1
        return ids

    def detokenize(self, ids):
        names = {token: piece for piece, token in {**CONTROLS, **WORD}.items()}
        return "".join(names.get(token, chr(token) if token < 0x110000 else "") for token in ids)


def test_plain_text_passes_unchanged():
    """Text without control tokens is not rewritten (mutation: every string placeholdered)."""
    control = ControlText(ToyBackend())
    assert control.neutral("hello <b> world") == "hello <b> world"
    assert control.texts == []


def test_control_token_text_becomes_a_placeholder():
    """A typed '<|im_end|>' is replaced by a numbered placeholder (mutation: control texts kept as they are)."""
    control = ControlText(ToyBackend())
    out = control.neutral("a<|im_end|>b<|im_end|>")
    assert out == "a" + PLACEHOLDER.format(0) + "b" + PLACEHOLDER.format(0)
    assert control.texts == ["<|im_end|>"]


def test_same_piece_keeps_its_number_across_strings():
    """One piece, one number over a conversation (mutation: a new number per occurrence or per string)."""
    control = ControlText(ToyBackend())
    first = control.neutral("<|im_start|>x")
    second = control.neutral("y<|im_end|><|im_start|>")
    assert first == PLACEHOLDER.format(0) + "x"
    assert second == "y" + PLACEHOLDER.format(1) + PLACEHOLDER.format(0)
    assert control.texts == ["<|im_start|>", "<|im_end|>"]


def test_reserved_private_use_characters_are_protected():
    """A typed placeholder character is itself replaced, so a user cannot forge a placeholder
    (mutation: RESERVED characters not checked)."""
    control = ControlText(ToyBackend())
    forged = "\ue0020\ue003"
    out = control.neutral(forged)
    assert out != forged
    assert "\ue002" in control.texts and "\ue003" in control.texts
    assert control.tokenize(out) == [ord(char) for char in forged]


def test_nested_values_keys_included_and_non_text_untouched():
    """Dicts (keys too) and lists are walked; numbers and None are left alone (mutation: keys or lists skipped)."""
    control = ControlText(ToyBackend())
    value = {"<|im_end|>": ["<|im_start|>", 3, None], "n": 1.5}
    out = control.neutral(value)
    assert out == {PLACEHOLDER.format(0): [PLACEHOLDER.format(1), 3, None], "n": 1.5}


def test_tokenize_parses_template_text_but_not_placeholders():
    """The template's own control text becomes one id; the protected piece stays plain characters
    (mutation: placeholders tokenised with special parsing, or template text without it)."""
    control = ControlText(ToyBackend())
    content = control.neutral("<|im_end|>")
    ids = control.tokenize("<|im_start|>" + content + "<|im_end|>")
    assert ids == [1001] + [ord(char) for char in "<|im_end|>"] + [1000]


def test_unknown_placeholder_number_is_left_as_text():
    """A placeholder with no text behind it is tokenised as the text around it (mutation: IndexError, or dropped)."""
    control = ControlText(ToyBackend())
    stray = PLACEHOLDER.format(7)
    assert control.tokenize("a" + stray) == [ord(char) for char in "a" + stray]


def test_ordinary_added_token_is_not_a_control_token():
    """A token made with and without special parsing is not protected (mutation: every added token
    treated as a control token)."""
    control = ControlText(ToyBackend())
    assert control.neutral("<b>") == "<b>"


def test_results_are_cached():
    """A string seen before is not tokenised again (mutation: cache dropped)."""
    backend = ToyBackend()
    control = ControlText(backend)
    control.neutral("x<|im_end|>")
    calls = backend.calls
    assert control.neutral("x<|im_end|>") == "x" + PLACEHOLDER.format(0)
    assert backend.calls == calls
