"""The artifact's chat template, rendered with jinja2 the way transformers and llama.cpp render it.

A sandboxed environment (templates come with downloaded models), ``raise_exception``,
``strftime_now`` and the ``tojson`` filter as transformers provides them (plain JSON, keys in order:
jinja's own filter escapes ``<``, ``>``, ``&`` and ``'`` as HTML and sorts keys, which no model was
trained on), and ``tools`` passed through so tool-aware templates (Qwen2.5, SmolLM2) describe them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Optional

from slm_align.chat_templates import chosen_chat_template
from slm_align.errors import UserError


def _raise(message: str):
    raise UserError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def render(template: Optional[str], messages: list[dict], bos_token: Optional[str], eos_token: Optional[str],
           tools: Optional[list[dict]] = None, add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` (and ``tools``), ending with the assistant's opening."""
    require_template(template)
    return _compile(template).render(messages=messages, tools=tools or None, bos_token=bos_token or "",
                                     eos_token=eos_token or "", add_generation_prompt=add_generation_prompt)


def require_template(template: Optional[str]) -> None:
    """The one-line refusal for a model without a chat template (base models have
    none), naming the ways out."""
    if not template:
        raise UserError("this artifact has no chat template (a base model?): pass --chat-template "
                        "chatml (or a Jinja file) to chat with one, or --raw to continue plain "
                        "text (Python: Agent.load(..., chat_template='chatml') or Agent.complete; "
                        "a server: /v1/completions)")


def use_chat_template(backend, option: Optional[str]) -> None:
    """Give ``backend`` the ``--chat-template`` ``option`` ("chatml" or a Jinja file) in
    place of its own, and record where it came from in ``backend.chat_template_origin``; None
    keeps the model's own."""
    if option is None:
        return
    chosen = chosen_chat_template(option)
    backend.chat_template = chosen.source
    backend.chat_template_origin = chosen.origin
