"""BFCL v4's own test data as function-calling task rows: the external yardstick of
``evaluate-agent --bfcl``.

The data ships in the PyPI package ``bfcl-eval`` (``bfcl_eval/data/BFCL_v4_<category>.json``:
JSON lines with ``id``, ``question`` (turns of messages) and ``function``;
``possible_answer/BFCL_v4_<category>.json``: ``id`` and ``ground_truth``; irrelevance has none).
It is located with :func:`importlib.util.find_spec`, which imports nothing: bfcl-eval's modules pin
numpy and API clients that clash with ours, so only its data files are read (install it with
``pip install --no-deps bfcl-eval==2026.3.23``).

Each entry's functions are offered as BFCL's OpenAI function-calling handler offers them
(``OpenAICompletionsHandler._compile_tools``: the Python hint BFCL appends to every description,
then ``convert_to_tool`` with ``GORILLA_TO_OPENAPI``: dots in names as underscores, BFCL's type
words as JSON-schema types, a ``float`` marked ``"format": "float"``). That conversion is re-written
here, not imported, for the reason above; ``tests/ondevice/agent/test_bfcl.py`` runs bfcl-eval's own
functions, taken from its files, on every entry of the five categories and compares. The rows keep
BFCL's original descriptions (``functions``) for the checker, which applies BFCL's type rules to
them (:mod:`slm_align.ondevice.rewards.function_match`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Optional, Sequence

from slm_align.errors import UserError

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
"""The BFCL v4 categories ``--bfcl`` reads: single-turn, Python, checked by AST (or no call)."""
VERSION = "BFCL_v4"
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
"""What BFCL appends to each function's description in its Python categories
(``_get_language_specific_hint``)."""
GORILLA_TO_OPENAPI = {
    "integer": "integer", "number": "number", "float": "number", "string": "string",
    "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
    "object": "object", "tuple": "array", "any": "string", "byte": "integer", "short": "integer",
    "long": "integer", "double": "number", "char": "string", "ArrayList": "array",
    "Array": "array", "HashMap": "object", "Hashtable": "object", "Queue": "array",
    "Stack": "array", "Any": "string", "String": "string", "Bigint": "integer",
}
"""BFCL's type words as OpenAPI types (``bfcl_eval.constants.type_mappings.GORILLA_TO_OPENAPI``)."""
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23"


def data_dir() -> Path:
    """bfcl-eval's data folder, found without importing the package; not installed: UserError."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"--bfcl reads BFCL's data from the package bfcl-eval, which is not installed; "
                        f"install it with `{INSTALL}`")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not (folder / f"{VERSION}_simple_python.json").is_file():
        raise UserError(f"bfcl-eval at {folder.parent} has no {VERSION} data; install it with `{INSTALL}`")
    return folder


def parse_categories(text: str) -> list[str]:
    """``simple_python,multiple`` as a list; an unknown category is a one-line UserError."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CATEGORIES]
    if unknown or not names:
        raise UserError(f"--bfcl: unknown BFCL category {(unknown or [text])[0]!r}; choose from "
                        f"{','.join(CATEGORIES)}")
    return list(dict.fromkeys(names))


def _cast_types(properties: dict) -> dict:
    """BFCL's ``_cast_to_openai_type``: each property's type as an OpenAPI type (unknown: string),
    a float noted in its description, nested properties and element types one or two levels down."""
    for value in properties.values():
        kind = value.get("type")
        if kind == "float":
            value["format"] = "float"
            value["description"] += " This is a float type value."
        value["type"] = GORILLA_TO_OPENAPI.get(kind, "string")
        if value["type"] not in ("array", "object"):
            continue
        if "properties" in value:
            value["properties"] = _cast_types(value["properties"])
        elif "items" in value:
            items = value["items"]
            items["type"] = GORILLA_TO_OPENAPI[items["type"]]
            if items["type"] == "array" and "items" in items:
                items["items"]["type"] = GORILLA_TO_OPENAPI[items["items"]["type"]]
            elif items["type"] == "object" and "properties" in items:
                items["properties"] = _cast_types(items["properties"])
    return properties


def offered_tools(functions: Sequence[dict]) -> list[dict]:
    """BFCL's functions as its OpenAI function-calling handler offers them: the Python hint added
    to each description, then ``convert_to_tool(functions, GORILLA_TO_OPENAPI,
    ModelStyle.OPENAI_COMPLETIONS)``."""
    tools = []
    for function in copy.deepcopy(list(functions)):
        function["description"] = function["description"] + PYTHON_HINT
        function["name"] = function["name"].replace(".", "_")
        function["parameters"]["type"] = "object"
        function["parameters"]["properties"] = _cast_types(function["parameters"]["properties"])
        tools.append({"type": "function", "function": function})
    return tools


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_category(category: str, limit: Optional[int] = None, folder: Optional[Path] = None) -> list[dict]:
    """One category's entries (the first ``limit``) as function task rows: ``id``, ``category``,
    ``messages`` (the entry's one turn), ``tools`` (as BFCL's handler offers them), ``functions``
    (BFCL's own descriptions) and ``ground_truth`` ([] for irrelevance)."""
    folder = folder or data_dir()
    entries = _lines(folder / f"{VERSION}_{category}.json")[:limit]
    answers = {}
    possible = folder / "possible_answer" / f"{VERSION}_{category}.json"
    if possible.is_file():
        answers = {row["id"]: row["ground_truth"] for row in _lines(possible)}
    rows = []
    for entry in entries:
        rows.append({"id": entry["id"], "category": category, "messages": entry["question"][0],
                     "tools": offered_tools(entry["function"]), "functions": entry["function"],
                     "ground_truth": answers.get(entry["id"], [])})
    return rows


def load_bfcl(categories: Sequence[str], limit: Optional[int] = None) -> list[dict]:
    """The rows of each category in turn, the first ``limit`` of each."""
    folder = data_dir()
    return [row for category in categories for row in load_category(category, limit, folder)]
