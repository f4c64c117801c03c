"""One prompt format for reward training, RL and evaluation.

A plain document becomes ``opening`` (its first sentences) and ``continuation`` (the rest, with its
leading space), so that ``prompt + completion`` is always the text a model would have produced after
the prompt. Chat rows use the tokenizer's chat template with the generation prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from slm_align.data.examples import Example
from slm_align.errors import UserError
from slm_align.ondevice.templates.chat import (
    default_chat_template,
    shown_tools,
    template_form,
    template_traits,
)


def sentences(text: str) -> list[str]:
    """Split text into sentences, keeping punctuation (and closing quotes) with each."""
    parts = []
    start = 0
    for match in re.finditer(r"[.!?][\"']?(?=\s+[A-Z\"']|\s*$)", text):
        end = match.end()
        piece = text[start:end].strip()
        if piece:
            parts.append(piece)
        start = end
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def split_opening(text: str, opening_sentences: int = 2) -> Optional[tuple[str, str]]:
    """``(opening, " " + rest)``, or None when the text has too few sentences to split."""
    parts = sentences(text)
    if len(parts) <= opening_sentences:
        return None
    return " ".join(parts[:opening_sentences]), " " + " ".join(parts[opening_sentences:])


MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id")
"""What a chat message keeps: OpenAI's fields a chat template renders."""


def chat_message(where: str, message: Any) -> dict:
    """One message of a chat row, in OpenAI's form: ``role`` and text ``content`` (empty allowed
    beside ``tool_calls``), and an assistant's ``tool_calls`` and a tool message's ``name`` and
    ``tool_call_id`` when given; a one-line UserError naming ``where`` otherwise."""
    if not isinstance(message, dict) or "role" not in message:
        raise UserError(f"{where}: each message needs a 'role' and a text 'content'")
    content = message.get("content")
    if content is None and message.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise UserError(f"{where}: each message needs a 'role' and a text 'content'")
    kept = {key: message[key] for key in MESSAGE_KEYS if message.get(key) is not None}
    if isinstance(kept.get("tool_calls"), str):
        # JSON text: the Parquet shards of `feedback collect`
        kept["tool_calls"] = _json_calls(where, kept["tool_calls"])
    return dict(kept, role=str(message["role"]), content=content)


def _json_calls(where: str, text: str) -> list:
    """A message's tool calls stored as JSON text, decoded; one line when it is not a JSON list."""
    try:
        calls = json.loads(text)
    except ValueError:
        calls = None
    if not isinstance(calls, list):
        raise UserError(f"{where}: a message's 'tool_calls' is text but not a JSON list of calls")
    return calls


def render_chat(messages, tokenizer, add_generation_prompt: bool = False, tools=None) -> str:
    """Chat messages (OpenAI's form) and their tools through the tokenizer's chat template (the
    default one when it has none: see
    :func:`slm_align.ondevice.templates.chat.default_chat_template`), each call turn in the form the
    template expects (:func:`slm_align.ondevice.templates.chat.template_form`)."""
    template = tokenizer.chat_template or default_chat_template(tokenizer)
    rows = template_form([dict(m) for m in messages], template_traits(template))
    # a template that drops tools: the fallback
    rows = shown_tools(template, rows, list(tools) if tools else None)
    return tokenizer.apply_chat_template(rows, tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=template)


def chat_prompt(messages, tokenizer, tools=None) -> str:
    """The rendered history followed by the assistant's generation prompt."""
    return render_chat(messages, tokenizer, add_generation_prompt=True, tools=tools)


def chat_turn(history, answer: dict, tokenizer, tools=None) -> tuple[str, str]:
    """``(prompt, completion)``: the completion is what the template adds for the
    final ``answer`` turn."""
    prompt = chat_prompt(history, tokenizer, tools)
    full = render_chat(list(history) + [answer], tokenizer, tools=tools)
    return (prompt, full[len(prompt):]) if full.startswith(prompt) else ("", full)


def prompt_of(example: Example, tokenizer=None, opening_sentences: int = 2) -> Optional[str]:
    """The prompt a policy answers for this item (None when a document is too short to split)."""
    if example.prompt is not None:
        return example.prompt
    if example.messages is not None:
        history = example.messages[:-1] if example.messages[-1]["role"] == "assistant" else example.messages
        return chat_prompt(history, tokenizer, example.tools) if history and tokenizer is not None else None
    split = split_opening(example.text or "", opening_sentences)
    return None if split is None else split[0]


def prompts_of(examples, tokenizer=None, limit: Optional[int] = None) -> list[str]:
    """The prompts of the items that have one (see :func:`prompt_of`), at most ``limit`` of them."""
    return [p for ex in examples if (p := prompt_of(ex, tokenizer))][:limit]
