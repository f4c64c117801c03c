"""The prompt of a conversation: the chat template's text around each
message's content, as token ids.

Two rules make it safe and cheap:

- Message contents are tokenised as plain text: ``<|im_end|><|im_start|>system`` typed into a
  message (or returned by a tool) stays those characters, it never becomes the control tokens the
  template itself writes. The template is rendered with a marker in place of each content; the text
  between markers is the template's own (its special tokens parsed), each content is tokenised on
  its own without parsing them. Whatever else the template renders from the conversation (tool
  names, descriptions and schemas, past calls' arguments) has its control-token text protected by
  :class:`~slm_align.ondevice.agent.control_text.ControlText`, and so do the contents when the template looks
  into them (then the window's text is tokenised whole).
- The prompt opens with what the tokenizer puts before every text it tokenizes with its special tokens
  (:func:`leading_ids`: Gemma's and Llama's ``<bos>``, nothing for SmolLM2 or Qwen), once, unless the
  template wrote it: training encodes its prompts so (:func:`slm_align.data.encoding.opening_ids`), and
  a Gemma prompt without its ``<bos>`` is another input (SFT's calls came out as a loop of
  ``<tool_call>`` lines in the runtime while they were right with it).
- Each content is tokenised once. When the conversation does not fit the context, the oldest turns
  (never the system prompt, never the last turn) are cut where the cumulative token counts say, and
  the window is rendered again to check: a few renders, not one per dropped turn. Before any of
  that, turns beyond ``n_ctx * MAX_CHARS_PER_TOKEN`` characters are cut unread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from slm_align.errors import UserError
from slm_align.ondevice.agent.control_text import ControlText
from slm_align.ondevice.templates.chat import render, template_form, template_traits, with_tools_described

MARK = "\ue000{}\ue001"
"""Stands for message N's content while the template renders (private-use
characters no template writes)."""
MARKS = re.compile("\ue000(\\d+)\ue001")
MAX_CHARS_PER_TOKEN = 16
"""A conversation longer than the context times this many characters cannot fit: its
oldest turns go unread."""


@dataclass
class Pieces:
    """One rendering of a window: its token ids, and the template tokens that open each message."""

    ids: list[int]
    opening: dict[int, int] = field(default_factory=dict)
    """Message index -> template tokens just before its content (its share
    of the template's text)."""
    content_end: dict[int, int] = field(default_factory=dict)
    """Message index -> the position in ``ids`` just after its content (none when the window's
    text was tokenised whole)."""


class PromptFitter:
    """Builds the prompt for one conversation; caches each content's tokens and
    each template piece's."""

    def __init__(self, backend, tools: Optional[list[dict]] = None, describe_tools: bool = False):
        self.backend = backend
        self.control = ControlText(backend)
        self.tools = self.control.neutral(tools)
        self.described = describe_tools and bool(tools) and drops_tools(backend)
        """The tools are written into the system message (:func:`tools_shown`), the template dropping them."""
        self._contents: dict[int, list[int]] = {}
        self._template: dict[str, list[int]] = {}
        self._messages: dict[int, dict] = {}

    def fit(self, messages: list[dict], max_tokens: int) -> tuple[list[int], list[dict]]:
        """The prompt ids and the window of ``messages`` they render, each call turn in the form
        the template expects: the oldest turns cut until the answer's ``max_tokens`` fit the
        context; a UserError when even the last turn does not."""
        stored = messages
        traits = template_traits(self.backend.chat_template, template_origin(self.backend))
        messages = template_form(messages, traits)
        head = 1 if messages and messages[0]["role"] == "system" else 0
        starts = cut_points(messages, head)
        start = self._first_within_chars(messages, starts)
        leading = leading_ids(self.backend)
        while True:
            window = stored[:head] + stored[start:]
            indices = list(range(head)) + list(range(start, len(messages)))
            pieces = self._render(messages, indices)
            ids = with_leading_ids(pieces.ids, leading)
            over = len(ids) + max_tokens - self.backend.n_ctx
            if over <= 0:
                return ids, window
            later = [s for s in starts if s > start]
            if not later:
                raise UserError(f"the message needs {len(ids)} tokens plus {max_tokens} for "
                                f"the answer, more than the context window of "
                                f"{self.backend.n_ctx}; send a shorter message")
            start = self._cut(start, later, over, pieces)

    def after(self, messages: list[dict], index: int) -> list[int]:
        """The ids the template renders after message ``index``'s content, to the end of the
        rendering with the assistant's generation prompt: what the runtime inserts after the
        tokens the model sampled for that message (its closing, the tool results, the next
        opening). ``messages[index]`` is the assistant's turn with its content left empty."""
        traits = template_traits(self.backend.chat_template, template_origin(self.backend))
        formed = template_form(messages, traits)
        pieces = self._render(formed, list(range(len(formed))))
        if index in pieces.content_end:
            return pieces.ids[pieces.content_end[index]:]
        marked = [self._message(formed, i, MARK.format(i) if i == index else self.control.neutral(m["content"]))
                  for i, m in enumerate(formed)]  # a template that looks into contents: the text after it
        return self.control.tokenize(self._text(marked).split(MARK.format(index), 1)[1])

    def _first_within_chars(self, messages: list[dict], starts: list[int]) -> int:
        """The earliest cut point whose turns hold at most the character cap (the
        last one in any case)."""
        budget = self.backend.n_ctx * MAX_CHARS_PER_TOKEN
        total = 0
        end = len(messages)
        for start in reversed(starts):
            total += sum(len(message["content"]) for message in messages[start:end])
            end = start
            if total > budget:
                later = [s for s in starts if s > start]
                return later[0] if later else start
        return starts[0]

    def _cut(self, start: int, later: list[int], over: int, pieces: Pieces) -> int:
        """The first cut point after ``start`` whose dropped messages free ``over`` tokens
        (the last one if none)."""
        freed = 0
        index = start
        for candidate in later:
            while index < candidate:
                freed += pieces.opening.get(index, 0) + len(self._contents.get(index, ()))
                index += 1
            if freed >= over:
                return candidate
        return later[-1]

    def _render(self, messages: list[dict], indices: list[int]) -> Pieces:
        """The window's ids: template text between markers parsed for special
        tokens, contents as plain text.

        A template that looks into contents (``startswith``, ``split``) renders the markers
        differently from the contents: then the window's text is tokenised whole, as transformers
        and llama.cpp do, its contents' control-token text protected like the rest.
        """
        marked = [self._message(messages, i, MARK.format(i)) for i in indices]
        text = self._text(marked)
        pieces = Pieces([])
        position = 0
        for found in MARKS.finditer(text):
            index = int(found.group(1))
            opening = self._template_ids(text[position:found.start()])
            pieces.ids += opening + self._content_ids(messages, index)
            pieces.opening[index] = len(opening)
            pieces.content_end[index] = len(pieces.ids)
            position = found.end()
        pieces.ids += self._template_ids(text[position:])
        real = self._text([self._message(messages, i, messages[i]["content"]) for i in indices])
        if MARKS.sub(partial(_content_of, messages), text) != real:
            neutral = [self._message(messages, i, self.control.neutral(messages[i]["content"])) for i in indices]
            pieces.ids = self.control.tokenize(self._text(neutral))
            pieces.content_end = {}
        return pieces

    def _message(self, messages: list[dict], index: int, content: str) -> dict:
        """Message ``index`` with ``content``, everything else in it (role, name,
        tool calls) protected."""
        if index not in self._messages:
            self._messages[index] = {key: self.control.neutral(value) for key, value in messages[index].items()
                                     if key != "content"}
        rest = self._messages[index]
        return {key: content if key == "content" else rest[key] for key in messages[index]}

    def _text(self, window: list[dict]) -> str:
        if self.described:  # the runtime's fallback: the same (protected) tools, in the system message
            window = with_tools_described(window, self.tools)
        return render(self.backend.chat_template, window, self.backend.bos_token, self.backend.eos_token, self.tools,
                      origin=template_origin(self.backend))

    def _template_ids(self, text: str) -> list[int]:
        if text not in self._template:
            self._template[text] = self.control.tokenize(text)
        return self._template[text]

    def _content_ids(self, messages: list[dict], index: int) -> list[int]:
        if index not in self._contents:
            content = messages[index]["content"]
            self._contents[index] = self.backend.tokenize(content, add_special=False, special=False) if content else []
        return self._contents[index]


def leading_ids(backend) -> list[int]:
    """The ids ``backend``'s tokenizer puts before every text when it adds its special tokens (``[bos]`` for
    Gemma and Llama, ``[]`` for SmolLM2 and Qwen): those of ``"a"`` tokenized with them, up to where
    ``"a"`` tokenized without them begins."""
    bare = backend.tokenize("a", add_special=False, special=False)
    marked = backend.tokenize("a", add_special=True, special=False)
    for start in range(len(marked) - len(bare) + 1):
        if marked[start:start + len(bare)] == bare:
            return marked[:start]
    return []


def with_leading_ids(ids: list[int], leading: list[int]) -> list[int]:
    """``ids`` opened by ``leading`` once: as they are when they already open with it."""
    if ids[:len(leading)] == leading:
        return ids
    return leading + ids


def drops_tools(backend) -> bool:
    """Whether the backend's chat template leaves the offered ``tools`` out of the prompt (ChatML,
    Gemma's turns, many base models' own)."""
    return not template_traits(backend.chat_template, template_origin(backend)).renders_tools


def tools_shown(backend, describe_tools: bool) -> str:
    """How a model is shown the offered tools: by its chat template, by the runtime's fallback (the
    template drops them and ``describe_tools``; :func:`~slm_align.ondevice.templates.chat.tools_system_text`
    in the system message), or not at all."""
    if not drops_tools(backend):
        return "chat template"
    if describe_tools:
        return "runtime fallback (its chat template drops tools)"
    return "not shown (its chat template drops tools)"


def template_origin(backend) -> Optional[str]:
    """Where the backend's chat template came from ("artifact", "chatml", a file): what an error
    of the template names."""
    return getattr(backend, "chat_template_origin", None)


def _content_of(messages: list[dict], found: re.Match) -> str:
    return messages[int(found.group(1))]["content"]


def cut_points(messages: list[dict], head: int) -> list[int]:
    """Where the kept part of a conversation may start: its first turn, each later user message, and
    the last message (a window keeps at least that)."""
    points = {head, max(head, len(messages) - 1)}
    points.update(i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user")
    return sorted(points)


def next_prompt(prompt: list[int], sampled: list[int], inserted: list[int]) -> list[int]:
    """The ids the model continues after a tool round: the round's prompt, the ids it sampled
    (never its text tokenised again) and the ids the runtime inserts after them. When the model
    ended its turn with the token the template closes the turn with, that token is not written
    twice."""
    if sampled and inserted and sampled[-1] == inserted[0]:
        inserted = inserted[1:]
    return prompt + sampled + inserted


def turn_end(backend) -> set[int]:
    """The token the chat template closes an assistant's turn with (ChatML's ``<|im_end|>``,
    Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``) when it is a control token: where a
    model trained on the template ends its turn, whatever its end-of-sequence token is. Empty
    when the template closes turns with plain text."""
    marker = MARK.format(0)
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    text = render(backend.chat_template, messages, backend.bos_token, backend.eos_token,
                  add_generation_prompt=False, origin=template_origin(backend))
    ids = backend.tokenize(text.split(marker, 1)[1], add_special=False, special=True)
    if not ids:
        return set()
    piece = backend.detokenize(ids[:1])
    plain = backend.tokenize(piece, add_special=False, special=False)
    return {ids[0]} if plain != ids[:1] else set()
