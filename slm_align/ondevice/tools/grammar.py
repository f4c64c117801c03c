"""A llama.cpp GBNF grammar that keeps a reply to free text or ``<tool_call>`` blocks
whose arguments follow the tools' JSON schemas (generic JSON where a schema says more
than a grammar can express).

Stdlib only: this module runs on phones and boards.
"""

from __future__ import annotations

import json
import re
from typing import Any

from slm_align.ondevice.tools.calls import Tool

_JSON_RULES = {
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* ws )? "}"',
    "array": '"[" ws ( value ( ws "," ws value )* ws )? "]"',
    "string": r'"\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""',
    "number": 'integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?',
    "integer": '"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "boolean": '"true" | "false"',
    "null": '"null"',
    "ws": '| " " | "\\n" [ \\t]{0,20}',
}
_TYPE_RULES = {"string", "number", "integer", "boolean", "null"}
_COMPACT_WS = '| " "'
"""Whitespace of a compact grammar: none or one space."""


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


class _GrammarBuilder:
    """Collects named GBNF rules; ``value`` turns a JSON schema into a rule expression."""

    def __init__(self):
        self.rules: dict[str, str] = {}
        self._next: dict[str, int] = {}
        """Per name base, the suffix to try first: every lower one is taken already."""

    def add(self, hint: str, body: str) -> str:
        """Add a rule with a name derived from ``hint`` (``base``, else the first free ``base-N``)
        and return the name.

        A rule is never removed, so a suffix once found taken stays taken: each base resumes
        where it stopped, and schemas whose many keys clean to one base (non-ASCII names) take
        linear time, not quadratic.
        """
        base = re.sub(r"[^A-Za-z0-9]+", "-", hint).strip("-").lower() or "rule"
        n = self._next.get(base, 1)
        name = base if n == 1 else f"{base}-{n}"
        while name in self.rules or name in _JSON_RULES or name == "root":
            n += 1
            name = f"{base}-{n}"
        self._next[base] = n + 1
        self.rules[name] = body
        return name

    def build(self, tools: list[Tool], free_text: bool = True, compact: bool = False) -> str:
        self.add("text-char", '[^<] | "<" [^A-Za-z/<]')
        self.add("free-text", "text-char+")
        root = "free-text"
        if tools:
            branches = " | ".join(self._call_branch(tool) for tool in tools)
            call = self.add(
                "tool-call",
                f'"<tool_call>" "\\n"? "{{" ws "\\"name\\"" ws ":" ws ( {branches} ) ws "}}" '
                            f'"\\n"? "</tool_call>"',
            )
            calls = f'{call} ( "\\n" {call} )*'
            root = f"{calls} | free-text" if free_text else calls
        json_rules = {**_JSON_RULES, "ws": _COMPACT_WS} if compact else _JSON_RULES
        lines = [f"root ::= {root}"] + [f"{k} ::= "
                                        f"{v}" for k, v in {**self.rules, **json_rules}.items()]
        return "\n".join(lines) + "\n"

    def _call_branch(self, tool: Tool) -> str:
        arguments = self.value(tool.parameters, f"{tool.name}-args")
        body = f'{_literal(json.dumps(tool.name))} ws "," ws "\\"arguments\\"" ws ":" ws {arguments}'
        return self.add(f"call-{tool.name}", body)

    def value(self, schema: Any, hint: str) -> str:
        """A GBNF expression for JSON values that follow ``schema`` (generic JSON
        where it cannot tell)."""
        if not isinstance(schema, dict):
            return "value"
        if "const" in schema:
            return _literal(json.dumps(schema["const"]))
        if "enum" in schema:
            return "( " + " | ".join(_literal(json.dumps(item)) for item in schema["enum"]) + " )"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = (self.value(option, f"{hint}-{i}")
                           for i, option in enumerate(schema[key]))
                return "( " + " | ".join(options) + " )"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "( " + " | ".join(self.value({**schema, "type": one}, f"{hint}-{one}")
                                     for one in kind) + " )"
        if kind in _TYPE_RULES:
            return kind
        if kind == "array":
            return self._array(schema, hint)
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self._object(schema, hint)
        if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
            return self._map(schema["additionalProperties"], hint)
        return "object" if kind == "object" else "value"

    def _array(self, schema: dict, hint: str) -> str:
        item = self.value(schema.get("items"), f"{hint}-item")
        return self.add(hint, f'"[" ws ( {item} ( ws "," ws {item} )* ws )? "]"')

    def _map(self, value_schema: dict, hint: str) -> str:
        entry = self.add(f"{hint}-entry", 'string ws ":" ws '
                                          f'{self.value(value_schema, f"{hint}-value")}')
        return self.add(hint, f'"{{" ws ( {entry} ( ws "," ws {entry} )* ws )? "}}"')

    def _object(self, schema: dict, hint: str) -> str:
        """Properties in schema order; required ones always, optional ones maybe, commas between.

        Built from the last property backwards: ``unwritten`` matches the members from the
        current one on when none was written yet, ``written`` the same when one was (so
        each starts with a comma).
        """
        required = set(schema.get("required", ()))
        # the members after the current one: when none / when one was written before
        unwritten = written = ""
        for key, sub in reversed(list(schema["properties"].items())):
            member_body = f'{_literal(json.dumps(key))} ws ":" ws {self.value(sub, f"{hint}-{key}")}'
            member = self.add(f"{hint}-{key}", member_body)
            after = self.add(f"{hint}-after-{key}", written) if written else ""
            if key in required:
                unwritten = f"{member} {after}".strip()
                written = f'ws "," ws {member} {after}'.strip()
                continue
            without = self.add(f"{hint}-without-{key}", unwritten) if unwritten else ""
            unwritten = f"( {member} {after} | {without} )" if without else f"( {member} {after} )?"
            written = f'( ws "," ws {member} )? {after}'.strip()
        return self.add(hint, f'"{{" ws {unwritten} ws "}}"' if unwritten else '"{" ws "}"')


def gbnf_grammar(tools: list[Tool], free_text: bool = True, compact: bool = False) -> str:
    """The grammar of a reply that calls one of ``tools`` (or, with ``free_text``, writes plain text
    instead); ``compact`` allows at most one space between JSON tokens."""
    return _GrammarBuilder().build(tools, free_text=free_text, compact=compact)
