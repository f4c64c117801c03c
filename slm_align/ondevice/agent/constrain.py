"""Constrained answers: llama.cpp grammars for structured output (a JSON
schema, or any JSON object).

llama-cpp-python's own converter (``json_schema_to_gbnf``, the one behind
``LlamaGrammar.from_json_schema``) turns a schema into GBNF; only the GGUF backend samples under a
grammar, so callers refuse the ONNX backend first.
"""

from __future__ import annotations

import json
from typing import Optional

from slm_align.errors import UserError

ANY_OBJECT = {"type": "object"}
"""``response_format`` ``json_object``: any JSON object (the converter's grammar
bounds the whitespace)."""


def json_grammar(schema: Optional[dict] = None) -> str:
    """A GBNF grammar admitting exactly the JSON that follows ``schema`` (None: any JSON object)."""
    try:
        from llama_cpp.llama_grammar import json_schema_to_gbnf
    except ImportError:
        raise UserError("structured output needs llama-cpp-python: pip "
                        "install 'slm-align[agent]'") from None
    try:
        return json_schema_to_gbnf(json.dumps(ANY_OBJECT if schema is None else schema))
    except Exception as exc:  # the converter asserts on what it cannot express (RecursionError included)
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise UserError(f"the JSON schema cannot be turned into a grammar ({reason})") from None
