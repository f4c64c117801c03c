"""The artifact's chat template, rendered with jinja2 the way transformers and llama.cpp render it.

A sandboxed environment (templates come with downloaded models), ``raise_exception``,
``strftime_now`` and the ``tojson`` filter as transformers provides them (plain JSON, keys in order:
jinja's own filter escapes ``<``, ``>``, ``&`` and ``'`` as HTML and sorts keys, which no model was
trained on), and ``tools`` passed through so tool-aware templates (Qwen2.5, SmolLM2) describe them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Optional

from slm_align.chat_templates import chosen_chat_template
from slm_align.errors import UserError
from slm_align.tools.calls import ToolCall
from slm_align.tools.parse import call_text


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


PROBE_TOOL = "probe_tool_7f3e"
PROBE_ARGUMENT = "probe_argument_7f3e"
PROBE_RESULT = "probe_result_7f3e"
_PROBE_SPEC = {"type": "function", "function": {"name": PROBE_TOOL, "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template does with a tool conversation, found by rendering a probe."""

    renders_tool_calls: bool
    """An assistant message's ``tool_calls`` appear in the text (Qwen2.5, Qwen3, Llama 3.2): a call is
    stored there. Otherwise (ChatML, SmolLM2, Gemma 3) only ``content`` is rendered, so the call's
    text goes into the content."""
    renders_tools: bool
    """The ``tools`` list appears in the prompt."""
    tool_results: Optional[str]
    """None when the template renders a ``tool`` message; else why it cannot (its error)."""


def _probe_messages(with_calls: bool) -> list[dict]:
    call = {"role": "assistant", "content": ""}
    if with_calls:
        call["tool_calls"] = [ToolCall(PROBE_TOOL, {"x": PROBE_ARGUMENT}).as_dict()]
    return [{"role": "user", "content": "probe"}, call,
            {"role": "tool", "name": PROBE_TOOL, "content": PROBE_RESULT}]


@lru_cache(maxsize=8)
def template_traits(template: str) -> TemplateTraits:
    """Render a probe tool conversation through ``template`` (no BOS/EOS text) and read what
    it shows."""
    tools = render(template, [{"role": "user", "content": "probe"}], None, None, [_PROBE_SPEC])
    try:
        text = render(template, _probe_messages(with_calls=True), None, None, [_PROBE_SPEC])
    except UserError as exc:
        return TemplateTraits(False, PROBE_TOOL in tools, str(exc))
    except Exception as exc:  # jinja2 raises several types for a conversation a template refuses
        return TemplateTraits(False, PROBE_TOOL in tools, f"{type(exc).__name__}: {exc}")
    shown = PROBE_ARGUMENT in text
    result = None if PROBE_RESULT in text else "it leaves tool results out"
    return TemplateTraits(shown, PROBE_TOOL in tools, result)


def template_form(messages: list[dict], traits: TemplateTraits) -> list[dict]:
    """A conversation stored in OpenAI's form (an assistant's calls in ``tool_calls``, each
    call stored once) in the form ``traits``' template renders: unchanged when it renders
    ``tool_calls``; otherwise each call turn's calls written into its content as the model
    writes them (:func:`~slm_align.tools.parse.call_text`), after any text outside them."""
    if traits.renders_tool_calls:
        return messages
    return [_calls_in_content(message) for message in messages]


def _calls_in_content(message: dict) -> dict:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    text = call_text([ToolCall(c["function"]["name"], _arguments(c["function"].get("arguments")))
                      for c in calls])
    content = message.get("content") or ""
    rest = {key: value for key, value in message.items() if key != "tool_calls"}
    return dict(rest, content=f"{content}\n{text}" if content else text)


def _arguments(arguments) -> dict:
    """A call's arguments as an object (OpenAI clients send them as JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return {"arguments": arguments}
    return arguments if isinstance(arguments, dict) else {}
