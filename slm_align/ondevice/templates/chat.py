"""Chat templates: the ones we supply (ChatML and Gemma's turns for a model without its own),
``--chat-template``'s value (``chatml`` or a Jinja file, its syntax checked before any work), a
template rendered with jinja2 the way transformers and llama.cpp render it, and what a template does
with a tool conversation. Shared by training (modeling, task data, SFT) and the torch-free runtime.

Rendering uses a sandboxed environment (templates come with downloaded models) whose every render is
bounded in steps, time and size (:mod:`slm_align.ondevice.templates.sandbox`): a template that
loops, or fails, is one :class:`ChatTemplateError` naming it, never a hang or a traceback;
``raise_exception``, ``strftime_now`` and the ``tojson`` filter as transformers provides them (plain
JSON, keys in order: jinja's own filter escapes ``<``, ``>``, ``&`` and ``'`` as HTML and sorts
keys, which no model was trained on), and ``tools`` passed through so tool-aware templates (Qwen2.5,
SmolLM2) describe them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

from slm_align.errors import UserError
from slm_align.ondevice.templates.sandbox import (
    TEMPLATE_CHARS,
    TemplateLimit,
    bounded_environment,
    render_bounded,
)
from slm_align.ondevice.templates.sandbox.checks import check_strftime
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.parse import FORMAT_HINT, call_text

# ChatML, used when a model has no chat template of its own (and by the bundled model).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n' }}{% endif %}"
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
        raise UserError(f"--chat-template {option}: neither chatml nor a readable template file; "
                        "pass chatml or a Jinja chat template file") from None
    _check_template_syntax(text, option)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    origin = f"{path.name} (sha256 {digest})"
    check_template(text, origin)
    return ChatTemplate(text, origin)


def _check_template_syntax(text: str, option: str) -> None:
    from jinja2 import Environment, TemplateSyntaxError

    if not text.strip():
        raise UserError(f"--chat-template {option} is empty; pass chatml or a "
                        "Jinja chat template file")
    try:
        Environment().parse(text)
    except TemplateSyntaxError as exc:
        raise UserError(f"--chat-template {option} is not a valid Jinja template (line "
                        f"{exc.lineno}: {exc.message}); fix it or pass chatml") from None


class ChatTemplateError(UserError):
    """A chat template that cannot render: bad syntax, a failing expression, ``{% include %}``, or a
    bound of :mod:`slm_align.ondevice.templates.sandbox` passed. One line naming the template; the
    CLI exits with 2, a server answers 400."""

    def __init__(self, message: str, cause: Optional[Exception] = None):
        super().__init__(message)
        self.cause = cause
        """What jinja2 or the sandbox raised."""

    @property
    def stopped(self) -> bool:
        """The template ran past a bound (rather than failing)."""
        return isinstance(self.cause, TemplateLimit)


def template_name(origin: Optional[str]) -> str:
    """How a message names the template: by its origin ("artifact", "chatml", a file's name and
    sha256) when known."""
    if origin is None:
        return "the chat template"
    if origin == "artifact":
        return "the model's own chat template"
    return f"the chat template {origin}"


REPLACE_IT = "fix the template, or pass --chat-template chatml (or a Jinja file) in its place"


def _template_error(exc: Exception, origin: Optional[str]) -> UserError:
    """The one-line error for an exception raised while ``origin``'s template compiled or
    rendered."""
    from jinja2 import TemplateSyntaxError

    name = template_name(origin)
    if isinstance(exc, TemplateLimit):
        return ChatTemplateError(f"{name} was stopped: {exc}; {REPLACE_IT}", exc)
    if isinstance(exc, TemplateSyntaxError):
        return ChatTemplateError(f"{name} is not a valid chat template (line {exc.lineno}: "
                                 f"{exc.message}); {REPLACE_IT}", exc)
    if isinstance(exc, UserError):  # raise_exception(): the template refuses this conversation
        return exc
    detail = " ".join(str(exc).split())[:200]
    return ChatTemplateError(f"{name} failed to render "
                             f"({type(exc).__name__}{': ' + detail if detail else ''}); "
                             f"{REPLACE_IT}", exc)


def _raise(message: str):
    raise UserError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    check_strftime(fmt)  # a short pattern without field widths: '%1000Y' * 660000 made 3.2 GB
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = bounded_environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.add_filters({"tojson": _tojson})
    return env.from_string(source)


def render(template: Optional[str], messages: list[dict], bos_token: Optional[str],
           eos_token: Optional[str], tools: Optional[list[dict]] = None,
           add_generation_prompt: bool = True, origin: Optional[str] = None) -> str:
    """The prompt text for ``messages`` (and ``tools``), ending with the assistant's opening.

    Bounded (:mod:`slm_align.ondevice.templates.sandbox`); a template that does not compile, fails
    or runs past a bound raises :class:`ChatTemplateError` naming it by ``origin``."""
    require_template(template)
    given = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    if given > TEMPLATE_CHARS:  # the conversation's fault, not the template's
        raise UserError(f"the conversation holds {given:,} characters, more than a prompt may "
                        f"({TEMPLATE_CHARS:,}); send a shorter message")
    try:
        return render_bounded(_compile(template), {
            "messages": messages, "tools": tools or None, "bos_token": bos_token or "",
            "eos_token": eos_token or "", "add_generation_prompt": add_generation_prompt})
    except Exception as exc:  # jinja2 raises many types for a template that fails
        raise _template_error(exc, origin) from None


CHECK_MESSAGES = [{"role": "user", "content": "Hello"}]
"""The conversation a template is tried on before it is used (every chat template renders it)."""


def check_template(template: Optional[str], origin: Optional[str] = None) -> None:
    """Render ``template`` once on :data:`CHECK_MESSAGES`: a template that loops or fails is refused
    (a :class:`ChatTemplateError` naming it) before a model is served or a chat starts. None (no
    template) passes."""
    if template:
        render(template, CHECK_MESSAGES, None, None, origin=origin)


def require_template(template: Optional[str]) -> None:
    """The one-line refusal for a model without a chat template (base models have
    none), naming the ways out."""
    if not template:
        raise UserError("this artifact has no chat template (a base model?): pass --chat-template "
                        "chatml (or a Jinja file) to chat with one, or --raw to continue plain "
                        "text (Python: Agent.load(..., chat_template='chatml') or Agent.complete; "
                        "a server: /v1/completions)")


PROBE_TOOL = "probe_tool_7f3e"
PROBE_ARGUMENT = "probe_argument_7f3e"
PROBE_RESULT = "probe_result_7f3e"
_PROBE_SPEC = {"type": "function", "function": {"name": PROBE_TOOL, "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template does with a tool conversation, found by rendering a probe."""

    renders_tool_calls: bool
    """An assistant message's ``tool_calls`` appear in the text (Qwen2.5, Qwen3, Llama 3.2): a call
    is stored there. Otherwise (ChatML, SmolLM2, Gemma 3) only ``content`` is rendered, so the
    call's text goes into the content."""
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
def template_traits(template: str, origin: Optional[str] = None) -> TemplateTraits:
    """Render a probe tool conversation through ``template`` (no BOS/EOS text) and read what
    it shows. A template stopped by a bound is a :class:`ChatTemplateError`, not a trait."""
    tools = render(template, [{"role": "user", "content": "probe"}], None, None, [_PROBE_SPEC],
                   origin=origin)
    try:
        text = render(template, _probe_messages(with_calls=True), None, None, [_PROBE_SPEC],
                      origin=origin)
    except ChatTemplateError as exc:
        if exc.stopped:
            raise
        return TemplateTraits(False, PROBE_TOOL in tools, f"{type(exc.cause).__name__}: "
                                                          f"{exc.cause}")
    except UserError as exc:
        return TemplateTraits(False, PROBE_TOOL in tools, str(exc))
    shown = PROBE_ARGUMENT in text
    result = None if PROBE_RESULT in text else "it leaves tool results out"
    return TemplateTraits(shown, PROBE_TOOL in tools, result)


def require_tool_template(template: Optional[str], origin: Optional[str] = None) -> TemplateTraits:
    """The template's traits, or a one-line UserError when it cannot show a tool conversation
    (Gemma 3's refuses a ``tool`` message): tools need a template that shows their results."""
    require_template(template)
    traits = template_traits(template, origin)
    if traits.tool_results is not None:
        reason = " ".join(traits.tool_results.split())[:160]
        raise UserError(f"the chat template cannot show tool results ({reason}); pass "
                        "--chat-template chatml, or a template that renders messages of role "
                        "'tool'")
    return traits


def template_form(messages: list[dict], traits: TemplateTraits) -> list[dict]:
    """A conversation stored in OpenAI's form (an assistant's calls in ``tool_calls``, each
    call stored once) in the form ``traits``' template renders: unchanged when it renders
    ``tool_calls``; otherwise each call turn's calls written into its content as the model
    writes them (:func:`~slm_align.ondevice.tools.parse.call_text`), after any text outside them."""
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


# The runtime's fallback for a template that drops ``tools``: the tools in the system message.
FALLBACK_HEADER = "Tools you can call (to call one, {hint}; its result comes back to you):"
"""Opens :func:`tools_system_text`."""


def _type(schema: dict) -> str:
    """A JSON schema's type in a few characters: its enum values, ``array of T``, or its type."""
    if "enum" in schema:
        return " | ".join(json.dumps(value, ensure_ascii=False) for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type(schema.get('items') or {})}"
    return " | ".join(kind) if isinstance(kind, list) else str(kind)


def tool_line(spec: dict) -> str:
    """One offered tool (an OpenAI function schema) as a signature line:
    ``- name(param: type = default, other: type (optional)): description``."""
    function = spec.get("function", spec)
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or ())
    parts = []
    for name, schema in (parameters.get("properties") or {}).items():
        part = f"{name}: {_type(schema)}"
        if "default" in schema:
            part += f" = {json.dumps(schema['default'], ensure_ascii=False)}"
        elif name not in required:
            part += " (optional)"
        parts.append(part)
    line = f"- {function['name']}({', '.join(parts)})"
    description = function.get("description")
    return f"{line}: {description}" if description else line


def tools_system_text(tools: list[dict]) -> str:
    """The offered tools as a system message's text: :data:`FALLBACK_HEADER`, then one
    :func:`tool_line` per tool.

    Written by hand, not as the tools' JSON schemas (the Hermes form tool-aware templates write):
    a signature line per tool costs a third of the tokens, which a small model's context needs
    (the bundled model's 512 tokens do not hold two schemas and a question).
    """
    return "\n".join([FALLBACK_HEADER.format(hint=FORMAT_HINT),
                      *(tool_line(tool) for tool in tools)])


def with_tools_described(messages: list[dict], tools: Optional[list[dict]]) -> list[dict]:
    """``messages`` with :func:`tools_system_text` in front of the system message's content (a
    system message first when there is none); unchanged without tools."""
    if not tools:
        return messages
    described = tools_system_text(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{described}\n\n{messages[0]['content']}")
        return [first] + messages[1:]
    return [{"role": "system", "content": described}] + messages


def shown_tools(template: str, messages: list[dict], tools: Optional[list[dict]]) -> list[dict]:
    """``messages`` as every renderer shows them with ``tools``: unchanged when ``template`` renders
    ``tools`` itself (or there are none), else with the fallback (:func:`with_tools_described`), the
    same for SFT chats, task prompts, RL episodes and the runtime."""
    if not tools or template_traits(template).renders_tools:
        return messages
    return with_tools_described(messages, tools)
