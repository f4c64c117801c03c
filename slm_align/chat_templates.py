"""Chat templates we supply: ChatML and Gemma's turns for a model without its own, and
``--chat-template``'s value (``chatml`` or a Jinja file, its syntax checked before any work). Shared
by training (modeling, task data) and the torch-free runtime.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from slm_align.errors import UserError

# ChatML, used when a model has no chat template of its own (and by the bundled model).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}"
)

# Gemma's turn format, used when a model whose vocabulary has Gemma's turn tokens has no
# template (Gemma 3 base GGUFs have none): those tokens are single pieces it knows, where
# ChatML's markers would be split into text. Gemma knows two roles; the assistant is "model" and
# every other role speaks as the user.
GEMMA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = 'user' %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def default_chat_template(tokenizer) -> str:
    """The template for a tokenizer without one: Gemma's turns when its vocabulary
    has them, else ChatML."""
    vocabulary = tokenizer.get_vocab()
    if "<start_of_turn>" in vocabulary and "<end_of_turn>" in vocabulary:
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


CHATML = "chatml"
"""``--chat-template chatml``: the built-in :data:`CHATML_TEMPLATE`."""


@dataclass(frozen=True)
class ChatTemplate:
    """A template given with ``--chat-template``: its Jinja text, and what is recorded
    about where it came from."""

    source: str
    """The Jinja text."""
    origin: str
    """"chatml", or the file's name and the start of its text's sha256."""


def chosen_chat_template(option: str) -> ChatTemplate:
    """``--chat-template``'s value: "chatml" (the built-in ChatML) or a Jinja file; a
    UserError for anything else."""
    if option == CHATML:
        return ChatTemplate(CHATML_TEMPLATE, CHATML)
    path = Path(option).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise UserError(f"--chat-template {option}: neither chatml nor a readable template file; pass chatml or a "
                        "Jinja chat template file") from None
    _check_template_syntax(text, option)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    return ChatTemplate(text, f"{path.name} (sha256 {digest})")


def _check_template_syntax(text: str, option: str) -> None:
    from jinja2 import Environment, TemplateSyntaxError

    if not text.strip():
        raise UserError(f"--chat-template {option} is empty; pass chatml or a Jinja chat template "
                        f"file")
    try:
        Environment().parse(text)
    except TemplateSyntaxError as exc:
        raise UserError(f"--chat-template {option} is not a valid Jinja template (line {exc.lineno}: {exc.message}); "
                        "fix it or pass chatml") from None
