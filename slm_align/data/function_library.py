"""The library of the function-calling task family: functions an app on a phone or a board exposes,
stored as data (``assets/functions/domains/<domain>.json``), and requests drawn for them.

A function of the library::

    {"name": "clock_alarm_add", "description": "...",
     "params": {"time": {"type": "string", "description": "...", "gen": "time"},
                "label": {"type": "string", "description": "...", "gen": "pool:alarm_label",
                          "default": ""}},
     "required": ["time"],
     "asks": ["Wake me at {time}[ for {label}]", "Set an alarm for {time}[ called {label}]"]}

Each ``asks`` template is one way to phrase a request: ``{param}`` (``{param.key}`` inside an
object parameter) is replaced by the words of a drawn value (:mod:`slm_align.data.function_values`),
a ``[...]`` part (holding optional parameters only) is kept or dropped at random. The ground truth
lists, per argument, the values a right call may carry (BFCL's possible-answer format): those of the
drawn value where the request says it, ``""`` and the default where it does not (an argument that
may be left out). Two optional keys shape the draws: ``differ`` names two slots that must not
get one value (``["from_unit", "to_unit"]``), ``once`` marks a function one request calls at most
once (it sets one state: a volume, a ringer mode), never drawn for a parallel row.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from importlib import resources

from slm_align.data.function_values import Value, draw

_SLOT = re.compile(r"\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?)\}")
_OPTIONAL_PART = re.compile(r"\[([^\[\]]*)\]")
_LIBRARY_KEYS = ("gen", "say")
"""Keys of a library parameter that only the generator reads (dropped from the offered schema)."""


@dataclass(frozen=True)
class Request:
    """A drawn request for one function: its ``text``, the ground-truth entry
    ``{name: {argument: [allowed values]}}`` and the words said per argument (``said``)."""

    text: str
    truth: dict
    said: dict
    opens_with_name: bool = False
    """Whether the text starts with a drawn name (kept capitalised inside a longer message)."""


@functools.cache
def library() -> tuple[dict, ...]:
    """Every function of the library, each with its ``domain`` and ``group`` (domains of one group
    overlap in meaning: never used as each other's irrelevant requests), sorted by name."""
    folder = resources.files("slm_align").joinpath("assets/functions/domains")
    functions = []
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".json"):
            continue
        domain = json.loads(entry.read_text(encoding="utf-8"))
        for function in domain["functions"]:
            functions.append({**function, "domain": domain["domain"], "group": domain["group"]})
    return tuple(sorted(functions, key=lambda function: function["name"]))


def function_named(name: str) -> dict:
    """The library function called ``name``."""
    return {function["name"]: function for function in library()}[name]


def _schema(param: dict) -> dict:
    """A library parameter as JSON schema: without the generator's keys, nested ones included."""
    schema = {key: value for key, value in param.items() if key not in _LIBRARY_KEYS}
    if "properties" in schema:
        schema["properties"] = {key: _schema(sub) for key, sub in schema["properties"].items()}
    if "items" in schema:
        schema["items"] = _schema(schema["items"])
    return schema


def tool_schema(function: dict) -> dict:
    """The function as an offered tool, in OpenAI's form (JSON-schema parameters)."""
    parameters = {"type": "object",
                  "properties": {name: _schema(param)
                                 for name, param in function["params"].items()},
                  "required": list(function["required"])}
    return {"type": "function", "function": {"name": function["name"],
                                             "description": function["description"],
                                             "parameters": parameters}}


def _keep_optional_parts(template: str, rng: random.Random) -> str:
    """The template with each ``[...]`` part kept (brackets dropped) or removed, at random."""
    def choose(match: re.Match) -> str:
        return match.group(1) if rng.random() < 0.5 else ""
    return _OPTIONAL_PART.sub(choose, template)


def _omitted(param: dict) -> list:
    """The allowed values of an argument the request does not give: left out, or its default."""
    if "default" in param and param["default"] != "":
        return ["", param["default"]]
    return [""]


def _said(param: dict, value: Value) -> list:
    """The allowed values of an argument the request gives; "" too where it is the default."""
    allowed = list(value.allowed)
    if "default" in param and value.value == param["default"]:
        allowed.append("")
    return allowed


def draw_request(function: dict, rng: random.Random) -> Request:
    """A request for ``function`` phrased by one of its templates, and its ground truth; the
    slots of its ``differ`` pair (a conversion's two units, a trip's two ends) drawn unequal."""
    first, second = function.get("differ", ("", ""))
    for _ in range(50):
        request, drawn = _drawn_request(function, rng)
        if first not in drawn or second not in drawn or drawn[first].value != drawn[second].value:
            break
    return request


def _drawn_request(function: dict, rng: random.Random) -> tuple[Request, dict[str, Value]]:
    """One request and the values drawn for its slots."""
    template = _keep_optional_parts(rng.choice(function["asks"]), rng)
    drawn: dict[str, Value] = {}

    def fill(match: re.Match) -> str:
        slot = match.group(1)
        if slot not in drawn:
            drawn[slot] = draw(_param(function, slot), rng)
        return drawn[slot].said

    text = _tidy(_SLOT.sub(fill, template))
    arguments = {name: _argument(name, param, drawn) for name, param in function["params"].items()}
    said = {slot: value.said for slot, value in drawn.items()}
    opening = _SLOT.match(template.lstrip())
    opens_with_name = bool(opening) and _param(function, opening.group(1))["gen"].startswith(("pool", "list"))
    return Request(text, {function["name"]: arguments}, said, opens_with_name), drawn


def _param(function: dict, slot: str) -> dict:
    """The parameter (or object key) a slot names."""
    name, _, key = slot.partition(".")
    param = function["params"][name]
    return param["properties"][key] if key else param


def _argument(name: str, param: dict, drawn: dict[str, Value]) -> list:
    """The allowed values of one argument: of its drawn value, of its drawn keys (an object:
    BFCL's form, one dict of allowed values per key), or of an argument left out."""
    if name in drawn:
        return _said(param, drawn[name])
    if param["type"] == "object" and any(slot.startswith(name + ".") for slot in drawn):
        keys = {}
        for key, sub in param["properties"].items():
            slot = f"{name}.{key}"
            keys[key] = _said(sub, drawn[slot]) if slot in drawn else _omitted(sub)
        return [keys]
    return _omitted(param)


def _tidy(text: str) -> str:
    """One space between words, no space before punctuation, a capital first letter."""
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([,.?!])", r"\1", text)
    return text[:1].upper() + text[1:]


def template_problems(function: dict) -> list[str]:
    """What is wrong with a library function's templates: a slot that names no parameter, a required
    parameter (or a required key of an object) some template does not always say, an optional part
    holding a required parameter. Empty when none."""
    problems = []
    params = function["params"]
    for template in function["asks"]:
        always = _SLOT.findall(_OPTIONAL_PART.sub("", template))
        for slot in _SLOT.findall(template):
            name, _, key = slot.partition(".")
            if name not in params or (key and key not in params[name].get("properties", {})):
                problems.append(f"{function['name']}: {template!r} names no parameter {slot!r}")
        for name in function["required"]:
            param = params[name]
            wanted = [name]
            if param["type"] == "object":
                wanted = [f"{name}.{key}" for key in param.get("required", [])]
            problems.extend(f"{function['name']}: {template!r} does not always say {slot!r}"
                            for slot in wanted if slot not in always)
    return problems
