"""An Ollama ``Modelfile`` beside an exported GGUF, so that ``ollama create NAME -f
model-Q8_0.Modelfile`` works.

The chat template is translated from Jinja (as transformers renders it: ``trim_blocks`` and
``lstrip_blocks``) to Ollama's Go-template syntax over ``.Messages``. Only a small, common subset
translates: one loop over the messages that prints their role and content between literal markers,
``if`` on the role, ``set`` of a string, and the generation prompt (which Ollama always renders).
Anything else (``loop.*``, filters, ``bos_token``, tools, macros) is reported as one line and the
``TEMPLATE`` is left out rather than written wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from jinja2 import Environment, nodes

from slm_align.errors import UserError

GENERATION_PROMPT = "add_generation_prompt"
MESSAGE_FIELDS = {"role": ".Role", "content": ".Content"}
# Ollama allocates the KV cache for num_ctx: the model's full window can be far more than needed
MAX_NUM_CTX = 4096
SAMPLING_PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       # generation_config.json -> Ollama PARAMETER
                       "repetition_penalty": "repeat_penalty"}


class Untranslatable(ValueError):
    """The Jinja template uses something the translator does not map to Ollama's syntax;
    the message says what."""


@dataclass
class Translation:
    """A chat template in Ollama's syntax and the turn markers around each
    message (for stop tokens)."""

    template: str
    turn_start: Optional[str] = None
    """Literal text just before a message's role ("<|im_start|>"), stripped;
    None when there is none."""
    turn_end: Optional[str] = None
    """Literal text just after a message's content ("<|im_end|>"), stripped;
    None when there is none."""


@dataclass
class _Scope:
    """What the translator knows where it stands: the loop variable inside the messages
    loop, the set variables."""

    variables: set[str]
    message: Optional[str] = None
    emitted: list[tuple[str, str]] = field(default_factory=list)
    """("text" | "action", value) printed inside the messages loop, in order: the turn
    markers are read from it."""


def _go_text(text: str) -> str:
    """Literal output: as it is, unless it holds template delimiters (then a Go string action)."""
    if "{{" in text or "}}" in text:
        return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"
    return text


def _name(node: nodes.Node) -> Optional[str]:
    return node.name if isinstance(node, nodes.Name) else None


def _message_field(node: nodes.Node, scope: _Scope) -> Optional[str]:
    """``message['role']`` or ``message.content`` inside the loop -> ".Role" /
    ".Content"; else None."""
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        key = node.arg.value
    elif isinstance(node, nodes.Getattr):
        key = node.attr
    else:
        return None
    if scope.message is None or _name(node.node) != scope.message:
        return None
    return MESSAGE_FIELDS.get(key)


def _pieces(node: nodes.Node, scope: _Scope) -> list[tuple[str, str]]:
    """An output expression as ("text", literal) and ("action", Go expression) pieces."""
    if isinstance(node, nodes.TemplateData):
        return [("text", node.data)]
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return [("text", node.value)]
    if isinstance(node, (nodes.Add, nodes.Concat)):
        parts = [node.left, node.right] if isinstance(node, nodes.Add) else node.nodes
        return [piece for part in parts for piece in _pieces(part, scope)]
    message_field = _message_field(node, scope)
    if message_field is not None:
        return [("action", message_field)]
    if _name(node) in scope.variables:
        return [("action", f"${_name(node)}")]
    raise Untranslatable(f"uses {_describe(node)}")


def _path(node: nodes.Node) -> Optional[str]:
    """``messages[0].role`` for names, attributes and subscripts; None for anything else."""
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, (nodes.Getattr, nodes.Getitem)):
        inner = _path(node.node) or "..."
        return f"{inner}.{node.attr}" if isinstance(node, nodes.Getattr) else f"{inner}[...]"
    return None


COMPARISONS = {"eq": "==", "ne": "!=", "gt": ">", "gteq": ">=", "lt": "<", "lteq": "<=", "in": "in",
               "notin": "not in"}
"""Jinja's comparison operators as written in a template."""


def _source(node: nodes.Node) -> Optional[str]:
    """A Jinja expression written back as template text (``loop.first and messages[0]['role'] !=
    'system'``), for a message that names what did not translate; None for a kind it does not write.
    Jinja keeps no source text per node (only line numbers), so the common kinds are written
    here."""
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Const):
        return repr(node.value)
    inner = _source(node.node) if isinstance(node, (nodes.Getattr, nodes.Getitem, nodes.Filter,
                                                     nodes.Test, nodes.Not, nodes.Call)) else None
    if isinstance(node, nodes.Getattr):
        return f"{inner}.{node.attr}"
    if isinstance(node, nodes.Getitem):
        return f"{inner}[{_source(node.arg) or '...'}]"
    if isinstance(node, nodes.Filter):
        return f"{inner} | {node.name}"
    if isinstance(node, nodes.Test):
        return f"{inner} is {node.name}"
    if isinstance(node, nodes.Call):
        return f"{inner}(...)"
    if isinstance(node, nodes.Compare):
        operations = " ".join(f"{COMPARISONS.get(op.op, op.op)} {_source(op.expr)}"
                              for op in node.ops)
        return f"{_source(node.expr)} {operations}"
    if isinstance(node, (nodes.And, nodes.Or)):
        word = "and" if isinstance(node, nodes.And) else "or"
        return f"{_source(node.left)} {word} {_source(node.right)}"
    if isinstance(node, nodes.Not):
        return f"not {_source(node.node)}"
    return None


def _describe(node: nodes.Node) -> str:
    """A short name for a Jinja node in a message: its variable path, filter, or the expression as
    written (``"loop.first and messages[0]['role'] != 'system'"``); a kind of node in words when it
    cannot be written."""
    path = _path(node)
    if path is not None:
        return f"'{path}'"
    if isinstance(node, nodes.Filter):
        return f"filter '{node.name}'"
    source = _source(node)
    if source is not None:
        return f'the condition "{source}"'
    return f"a Jinja {type(node).__name__} expression"


def _output(node: nodes.Output, scope: _Scope) -> str:
    pieces = [piece for child in node.nodes for piece in _pieces(child, scope)]
    if scope.message is not None:
        scope.emitted.extend(pieces)
    return "".join(_go_text(value) if kind == "text" else "{{ " + value + " }}"
                   for kind, value in pieces)


def _role_test(node: nodes.Node, scope: _Scope) -> str:
    """``message['role'] == 'user'`` (or !=) -> ``eq .Role "user"``."""
    if not isinstance(node, nodes.Compare) or len(node.ops) != 1 or node.ops[0].op not in ("eq", "ne"):
        raise Untranslatable(f"tests {_describe(node)}")
    left = node.expr
    right = node.ops[0].expr
    if isinstance(left, nodes.Const):
        left = node.ops[0].expr
        right = node.expr
    subject = _message_field(left, scope)
    if subject is None or not isinstance(right, nodes.Const) or not isinstance(right.value, str):
        raise Untranslatable(f"tests {_describe(left)}")
    return f"{node.ops[0].op} {subject} {json.dumps(right.value)}"


def _condition(node: nodes.If, scope: _Scope) -> str:
    if _name(node.test) == GENERATION_PROMPT:
        if node.elif_ or node.else_ or scope.message is not None:
            raise Untranslatable("branches on add_generation_prompt with an else")
        return _statements(node.body, scope)  # Ollama renders every prompt for generation
    text = "{{ if " + _role_test(node.test, scope) + " }}" + _statements(node.body, scope)
    for branch in node.elif_:
        text += "{{ else if " + _role_test(branch.test, scope) + " }}" + _statements(branch.body, scope)
    if node.else_:
        text += "{{ else }}" + _statements(node.else_, scope)
    return text + "{{ end }}"


def _loop(node: nodes.For, scope: _Scope) -> str:
    if _name(node.iter) != "messages" or _name(node.target) is None or scope.message is not None:
        raise Untranslatable("loops over something other than the messages")
    if node.else_ or node.test is not None or node.recursive:
        raise Untranslatable("uses a filtered or recursive loop")
    scope.message = _name(node.target)
    body = _statements(node.body, scope)
    scope.message = None
    return "{{ range .Messages }}" + body + "{{ end }}"


def _assignment(node: nodes.Assign, scope: _Scope) -> str:
    if _name(node.target) not in scope.variables or not isinstance(node.node, nodes.Const):
        raise Untranslatable("sets a variable to something other than a string")
    return "{{ $" + node.target.name + " = " + json.dumps(node.node.value) + " }}"


def _statements(body: list[nodes.Node], scope: _Scope) -> str:
    translators = {nodes.Output: _output, nodes.If: _condition, nodes.For: _loop,
                   nodes.Assign: _assignment}
    text = ""
    for node in body:
        translate = translators.get(type(node))
        if translate is None:
            raise Untranslatable(f"uses the statement {type(node).__name__}")
        text += translate(node, scope)
    return text


def _assigned_strings(template: nodes.Template) -> set[str]:
    return {assign.target.name for assign in template.find_all(nodes.Assign)
            if isinstance(assign.target, nodes.Name)}


def _marker_after(emitted: list[tuple[str, str]], action: str) -> Optional[str]:
    """The stripped literal right after the first ``action`` in the loop's output
    (the end-of-turn marker)."""
    for index, (kind, value) in enumerate(emitted[:-1]):
        if kind == "action" and value == action and emitted[index + 1][0] == "text":
            return emitted[index + 1][1].strip() or None
    return None


def _marker_before_role(emitted: list[tuple[str, str]]) -> Optional[str]:
    """The stripped literal right before the first role in the loop's output (the
    start-of-turn marker)."""
    for index, (kind, value) in enumerate(emitted[1:], start=1):
        if kind == "action" and value != ".Content" and emitted[index - 1][0] == "text":
            return emitted[index - 1][1].strip() or None
    return None


def translate_template(source: str) -> Translation:
    """Translate a Jinja chat template to Ollama's syntax; raises Untranslatable
    naming what it cannot map."""
    # as transformers compiles chat templates
    environment = Environment(trim_blocks=True, lstrip_blocks=True)
    try:
        parsed = environment.parse(source)
    except Exception as exc:
        # jinja2's TemplateSyntaxError, or anything else a broken template raises
        raise Untranslatable(f"does not parse ({exc})") from None
    variables = _assigned_strings(parsed)
    scope = _Scope(variables=variables)
    body = _statements(parsed.body, scope)
    if "{{ range .Messages }}" not in body:
        raise Untranslatable("has no loop over the messages")
    declarations = "".join("{{ $" + name + ' := "" }}' for name in sorted(variables))
    return Translation(template=declarations + body, turn_start=_marker_before_role(scope.emitted),
                       turn_end=_marker_after(scope.emitted, ".Content"))


def check_system_prompt(system: Optional[str]) -> None:
    """Refuse a system prompt the Modelfile cannot carry: one holding the Modelfile's triple quote
    (a target without a Modelfile refuses any:
    :meth:`~slm_align.export.targets.base.ExportTarget.check_system`)."""
    if system is None:
        return
    if '"""' in system:
        raise UserError('--system holds """, which a Modelfile cannot quote; '
                        'leave it out of the prompt')


def _quoted(text: str) -> str:
    return '"""' + text + '"""'


def default_parameters(checkpoint: Path) -> dict[str, float]:
    """num_ctx from the model's context window (capped at MAX_NUM_CTX) and the sampling its
    generation_config sets."""
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    parameters: dict[str, float] = {}
    window = config.get("max_position_embeddings") or config.get("n_positions")
    if window:
        parameters["num_ctx"] = min(int(window), MAX_NUM_CTX)
    generation = checkpoint / "generation_config.json"
    if generation.is_file():
        settings = json.loads(generation.read_text(encoding="utf-8"))
        for name, parameter in SAMPLING_PARAMETERS.items():
            if settings.get(name) is not None:
                parameters[parameter] = settings[name]
    return parameters


@dataclass
class Modelfile:
    """The Modelfile's text, and the one-line note when the chat template
    could not be translated."""

    text: str
    note: Optional[str] = None


def build_modelfile(gguf_name: str, chat_template: Optional[str], parameters: dict[str, float],
                    system: Optional[str] = None) -> Modelfile:
    """FROM the GGUF beside it, TEMPLATE (when it translates), stop tokens, default
    parameters, SYSTEM if given."""
    lines = [f"FROM ./{gguf_name}"]
    note = None
    translation = None
    try:
        translation = translate_template(chat_template or "")
        if '"""' in translation.template:
            raise Untranslatable('holds """, which a Modelfile cannot quote')
    except Untranslatable as exc:
        note = (f"Modelfile written without TEMPLATE: the chat template {exc}, which has no Ollama "
                "translation here; Ollama falls back to its guess from the GGUF")
        translation = None
    if translation is not None:
        lines.append(f"TEMPLATE {_quoted(translation.template)}")
        for stop in (translation.turn_start, translation.turn_end):
            if stop:
                lines.append(f"PARAMETER stop {json.dumps(stop)}")
    for name, value in parameters.items():
        lines.append(f"PARAMETER {name} {value}")
    if system:
        lines.append(f"SYSTEM {_quoted(system)}")
    return Modelfile(text="\n".join(lines) + "\n", note=note)


def modelfile_path(gguf: Path) -> Path:
    """``model-Q8_0.gguf`` -> ``model-Q8_0.Modelfile`` beside it."""
    return gguf.with_suffix(".Modelfile")
