"""Rewards for tool calls: ``json_tool_call`` (a well-formed call) and ``tool_task`` (partial credit
for the first call, read by the agent runtime's own parser and run with the runtime's tools; on
agent episodes, for the episode as the runtime ran it).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional, Sequence

import jsonschema

from slm_align.ondevice.rewards.answers import _as_number, normalise_answer, same_answer
from slm_align.ondevice.rewards.episodes import classify
from slm_align.ondevice.tools.builtin import default_tools
from slm_align.ondevice.tools.specs import normalise_tools, registry_for_row, tool_function

_CALL_SCHEMA = {"type": "object", "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}}}


def _first_json_object(text: str):
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            return decoder.raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            continue
    return None


def _tool_validators(tools) -> dict:
    """Tool name -> jsonschema validator of its parameters, for one row's ``tools``."""
    validators = {}
    for tool in normalise_tools("tools", tools) or []:
        function = tool_function(tool)
        parameters = function.get("parameters", {"type": "object"})
        validators[function["name"]] = jsonschema.validators.validator_for(parameters)(parameters)
    return validators


def _call_fits_tools(call: Any, validators: dict) -> bool:
    """The call names one of the tools and its arguments validate against that tool's parameters."""
    if not isinstance(call, dict) or call.get("name") not in validators:
        return False
    arguments = call.get("arguments")
    return isinstance(arguments, dict) and validators[call["name"]].is_valid(arguments)


def json_tool_call(prompts, completions, schema: Optional[dict] = None,
                   tools: Optional[Sequence[Any]] = None, **_) -> list[float]:
    """1 for a valid JSON tool call ``{"name", "arguments"}``; 0.5 for other JSON; 0 for none.

    Valid means: against ``schema`` when given; else, when the row has a ``tools`` column (OpenAI
    function schemas), the name is one of the row's tools and the arguments validate against its
    ``parameters``; else the generic call shape.
    """
    generic = jsonschema.Draft202012Validator(schema or _CALL_SCHEMA)
    cache: dict[str, dict] = {}
    scores = []
    for index, completion in enumerate(completions):
        call = _first_json_object(completion)
        row_tools = None if schema is not None or tools is None else tools[index]
        if call is None:
            score = 0.0
        elif row_tools:
            key = json.dumps(row_tools, sort_keys=True, default=str)
            if key not in cache:
                cache[key] = _tool_validators(row_tools)
            score = 1.0 if _call_fits_tools(call, cache[key]) else 0.5
        else:
            score = 1.0 if generic.is_valid(call) else 0.5
        scores.append(score)
    return scores


json_tool_call.columns = frozenset()
json_tool_call.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)


TOOL_TASK_SCORES = {"no_call": 0.0, "malformed": 0.25, "wrong_tool": 0.5, "wrong_answer": 0.75,
                    "solved": 1.0}
EPISODE_SCORES = {"no_call": TOOL_TASK_SCORES["no_call"],
                  "malformed_call": TOOL_TASK_SCORES["malformed"],
                  "wrong_tool": TOOL_TASK_SCORES["wrong_tool"],
                  "wrong_answer": TOOL_TASK_SCORES["wrong_answer"],
                  "success": TOOL_TASK_SCORES["solved"]}
"""``tool_task`` on an episode: the score of its category
(:func:`~slm_align.ondevice.rewards.episodes.classify`)."""


@functools.lru_cache(maxsize=1)
def _builtin_registry():
    return default_tools()


def _first_call(text: str, registry):
    """The runtime parser's view of the reply's first tool call: ``(ToolCall or
    None, wanted a tool)``."""
    end = text.find("</tool_call>")
    head = text if end < 0 else text[:end + len("</tool_call>")]
    parsed = registry.parse_calls(head)
    if parsed.errors or not parsed.calls:
        return None, parsed.wants_tools
    return parsed.calls[0], True


def _result_matches(result: str, answer: Any) -> bool:
    """The tool's result is the answer: by value for numbers, else equal or
    containing it as a whole phrase."""
    if answer is None:
        return False
    if same_answer(result, answer):
        return True
    wanted = normalise_answer(answer)
    if not wanted or _as_number(wanted) is not None:
        return False
    return bool(re.search(rf"(?<!\w){re.escape(wanted)}(?!\w)", normalise_answer(result)))


def _tool_task_score(text: str, registry, expected_tool: Optional[str], answer: Any) -> float:
    call, wanted = _first_call(text, registry)
    if call is None:
        return TOOL_TASK_SCORES["malformed"] if wanted else TOOL_TASK_SCORES["no_call"]
    parameters = registry.get(call.name).parameters
    if not jsonschema.validators.validator_for(parameters)(parameters).is_valid(call.arguments):
        return TOOL_TASK_SCORES["malformed"]
    if expected_tool and call.name != expected_tool:
        return TOOL_TASK_SCORES["wrong_tool"]
    observation = registry.execute(call)
    if observation.ok and _result_matches(observation.content, answer):
        return TOOL_TASK_SCORES["solved"]
    return TOOL_TASK_SCORES["wrong_answer"]


def tool_task(prompts, completions, answer: Optional[Sequence[Any]] = None,
              tools: Optional[Sequence[Any]] = None, tool: Optional[Sequence[Optional[str]]] = None,
              registry=None, episodes: Optional[Sequence[dict]] = None, **_) -> list[float]:
    """Partial credit for the completion's first tool call, read by the agent runtime's
    parser (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or a bare call
    object as the whole reply):

    - 0    no tool call;
    - 0.25 a call that does not parse, names no known tool, or whose
      arguments break the tool's schema;
    - 0.5  a valid call to the wrong tool (the ``tool`` column, the expected tool's
      name, when the data has it);
    - 0.75 the right tool with valid arguments, but running it does not give the row's ``answer``
      (or it cannot be run here);
    - 1.0  running the call gives the ``answer`` (by value when both are numbers, else the
      same text or a result containing it as a whole phrase, as the clock's "... (Monday,
      UTC)" contains "Monday").

    On agent episodes (``episodes=``) the episode itself is scored on the same scale by its category
    (:data:`EPISODE_SCORES`): 1.0 when its final answer is the row's ``answer``, 0.75 when the right
    tool ran but the answer is wrong, 0.5 for another tool, 0.25 for calls that failed, 0 for none.

    The known tools are the row's ``tools`` column (OpenAI function schemas) when present, else the
    built-in tools. Calls run with the same-named tool of ``registry``, by default the built-in
    calculator and clock (:func:`~slm_align.ondevice.tools.builtin.default_tools`, safe by
    construction); bind your own registry with ``functools.partial(tool_task, registry=...)`` to run
    other tools. The scale is :data:`TOOL_TASK_SCORES`.
    """
    if episodes is not None:
        return [EPISODE_SCORES[classify(view["calls"], view["answer"], answer[i],
                                        None if tool is None else tool[i])]
                for i, view in enumerate(episodes)]
    executables = registry or _builtin_registry()
    registries: dict[str, Any] = {}
    scores = []
    for index, completion in enumerate(completions):
        row_tools = None if tools is None else tools[index]
        key = json.dumps(row_tools, sort_keys=True, default=str)
        if key not in registries:
            registries[key] = registry_for_row(row_tools, executables) if row_tools else executables
        expected = None if tool is None else tool[index]
        cell = None if answer is None else answer[index]
        scores.append(_tool_task_score(completion, registries[key], expected, cell))
    return scores


tool_task.columns = frozenset({"answer"})
tool_task.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)
