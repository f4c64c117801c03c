"""Reward functions: anything that scores (prompt, completion) batches.

The protocol is a callable ``fn(prompts, completions, **context) -> list[float]``. Following TRL, every column
of the task data other than the prompt arrives as a keyword list aligned with the completions
(``fn(prompts, completions, answer=[...], tools=[...], **rest)``: see :func:`with_columns`); ``context`` may also
carry ``references`` (reference answers of prompt/completion data) and, for sampled completions, ``truncated``
(one bool each: the completion hit the token budget without EOS). A keyword parameter without a default (or a
``columns`` attribute, as the built-ins have) names a column the reward needs: :func:`check_columns` reports a
missing one before training. Give a reward from the CLI as ``module:function`` (optionally
``module:function@weight``) or a built-in name; from Python, pass the callable. The learned reward model is one
such function (:class:`LearnedReward`), and :class:`CombinedReward` sums weighted terms.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from slm_align.errors import UserError

RewardFn = Callable[..., Sequence[float]]

# Keywords the callers pass themselves: never columns a reward can require.
CONTEXT_KEYS = frozenset({"truncated", "references"})


def length_window(prompts, completions, min_words: int = 20, max_words: int = 80, **_) -> list[float]:
    """1 inside ``[min_words, max_words]``, falling linearly to 0 at no words and at twice ``max_words``."""
    scores = []
    for completion in completions:
        n = len(completion.split())
        if n < min_words:
            scores.append(n / min_words)
        elif n <= max_words:
            scores.append(1.0)
        else:
            scores.append(max(0.0, 1.0 - (n - max_words) / max_words))
    return scores




length_window.columns = frozenset()

_ANSWER = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?|####)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_NUMERIC = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def extract_answer(text: str) -> str:
    """The final answer in a completion: after "Answer:"/"####", else its last number, else the whole text."""
    found = _ANSWER.findall(text)
    if found:
        text = found[-1]
    else:
        numbers = _NUMBER.findall(text)
        text = numbers[-1] if numbers else text
    return normalise_answer(text)


def normalise_answer(text: Any) -> str:
    """Lower case, single spaces, no trailing period and no thousands commas (``"1,000."`` is ``"1000"``)."""
    return " ".join(str(text).strip().strip(".").lower().split()).replace(",", "")


def _as_number(text: str) -> Optional[float]:
    """The value of a normalised answer that is a plain number, else None."""
    return float(text) if _NUMERIC.fullmatch(text) else None


def same_answer(candidate: Any, reference: Any) -> bool:
    """True when the two answers are equal once normalised, or are numbers with equal values (350 and 350.0)."""
    left = normalise_answer(candidate)
    right = normalise_answer(reference)
    if left == right:
        return True
    a = _as_number(left)
    b = _as_number(right)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _reference_of(answer: Any) -> Optional[str]:
    """An ``answer`` cell as a normalised answer: the text after "####"/"Answer:" when it has one (GSM8K's
    solutions do), else the whole cell."""
    if answer is None:
        return None
    found = _ANSWER.findall(str(answer))
    return normalise_answer(found[-1] if found else answer)


def final_answer_matches(completion: str, reference: str) -> bool:
    """Whether a completion's final answer is ``reference`` (normalised).

    After an "Answer:"/"####" marker the text there (or its first number) must equal it; without a marker a
    numeric reference is compared with the completion's last number, and a text one must end the completion.
    """
    found = _ANSWER.findall(completion)
    if found:
        numbers = _NUMBER.findall(found[-1])
        return same_answer(found[-1], reference) or bool(numbers and same_answer(numbers[0], reference))
    if _as_number(reference) is not None:
        numbers = _NUMBER.findall(completion)
        return bool(numbers) and same_answer(numbers[-1], reference)
    text = normalise_answer(completion)
    return text == reference or bool(re.search(rf"(?<!\w){re.escape(reference)}$", text))


def exact_answer(prompts, completions, answer: Optional[Sequence[Any]] = None,
                 references: Optional[Sequence[Optional[str]]] = None, **_) -> list[float]:
    """1 when the completion's final answer equals the row's ``answer`` column, else 0.

    Numbers compare by value (``350`` equals ``350.0``, ``1,000`` equals ``1000``); see
    :func:`final_answer_matches`. ``references=`` (reference completions, whose own final answer counts) is the
    older way to give the answers and still works.
    """
    if answer is not None:
        wanted = [_reference_of(cell) for cell in answer]
    elif references is not None:
        wanted = [None if ref is None else extract_answer(ref) for ref in references]
    else:
        raise UserError("the exact_answer reward needs reference answers: give task data with an 'answer' column")
    if len(wanted) != len(completions):
        raise UserError(f"the exact_answer reward got {len(wanted)} answers for {len(completions)} completions")
    return [float(ref is not None and final_answer_matches(c, ref)) for c, ref in zip(completions, wanted)]


exact_answer.columns = frozenset({"answer"})

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
    import jsonschema

    from slm_align.data.tasks import normalise_tools, tool_function

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


def json_tool_call(prompts, completions, schema: Optional[dict] = None, tools: Optional[Sequence[Any]] = None,
                   **_) -> list[float]:
    """1 for a valid JSON tool call ``{"name", "arguments"}``; 0.5 for other JSON; 0 for none.

    Valid means: against ``schema`` when given; else, when the row has a ``tools`` column (OpenAI function
    schemas), the name is one of the row's tools and the arguments validate against its ``parameters``; else the
    generic call shape.
    """
    import jsonschema

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


# --- tool-use tasks -------------------------------------------------------------------------------

TOOL_TASK_SCORES = {"no_call": 0.0, "malformed": 0.25, "wrong_tool": 0.5, "wrong_answer": 0.75, "solved": 1.0}


class _Unavailable:
    """Stands in for a tool of the task's schemas that this reward cannot run."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, **_):
        raise ValueError(f"{self.name} cannot be run by the tool_task reward (pass registry= with it)")


@functools.lru_cache(maxsize=1)
def _builtin_registry():
    from slm_align.agent.builtin_tools import default_tools

    return default_tools()


def _registry_for(row_tools, executables):
    """A registry with the row's tool schemas, each running the same-named tool of ``executables`` (if any)."""
    from slm_align.agent.tools import ToolRegistry
    from slm_align.data.tasks import normalise_tools, tool_function

    registry = ToolRegistry()
    for tool in normalise_tools("tools", row_tools) or []:
        function = tool_function(tool)
        name = function["name"]
        parameters = {"type": "object", **function.get("parameters", {})}
        runnable = executables.get(name)
        registry.register(runnable.function if runnable else _Unavailable(name), name=name,
                          description=function.get("description") or name, schema=parameters)
    return registry


def _first_call(text: str, registry):
    """The runtime parser's view of the reply's first tool call: ``(ToolCall or None, wanted a tool)``."""
    end = text.find("</tool_call>")
    head = text if end < 0 else text[:end + len("</tool_call>")]
    parsed = registry.parse_calls(head)
    if parsed.errors or not parsed.calls:
        return None, parsed.wants_tools
    return parsed.calls[0], True


def _result_matches(result: str, answer: Any) -> bool:
    """The tool's result is the answer: by value for numbers, else equal or containing it as a whole phrase."""
    if answer is None:
        return False
    if same_answer(result, answer):
        return True
    wanted = normalise_answer(answer)
    if not wanted or _as_number(wanted) is not None:
        return False
    return bool(re.search(rf"(?<!\w){re.escape(wanted)}(?!\w)", normalise_answer(result)))


def _tool_task_score(text: str, registry, expected_tool: Optional[str], answer: Any) -> float:
    import jsonschema

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


def tool_task(prompts, completions, answer: Optional[Sequence[Any]] = None, tools: Optional[Sequence[Any]] = None,
              tool: Optional[Sequence[Optional[str]]] = None, registry=None, **_) -> list[float]:
    """Partial credit for the completion's first tool call, read by the agent runtime's parser
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or a bare call object as the whole reply):

    - 0    no tool call;
    - 0.25 a call that does not parse, names no known tool, or whose arguments break the tool's schema;
    - 0.5  a valid call to the wrong tool (the ``tool`` column, the expected tool's name, when the data has it);
    - 0.75 the right tool with valid arguments, but running it does not give the row's ``answer`` (or it cannot
      be run here);
    - 1.0  running the call gives the ``answer`` (by value when both are numbers, else the same text or a result
      containing it as a whole phrase, as the clock's "... (Monday, UTC)" contains "Monday").

    The known tools are the row's ``tools`` column (OpenAI function schemas) when present, else the built-in
    tools. Calls run with the same-named tool of ``registry``, by default the built-in calculator and clock
    (:func:`~slm_align.agent.builtin_tools.default_tools`, safe by construction); bind your own registry with
    ``functools.partial(tool_task, registry=...)`` to run other tools. The scale is :data:`TOOL_TASK_SCORES`.
    """
    executables = registry or _builtin_registry()
    registries: dict[str, Any] = {}
    scores = []
    for index, completion in enumerate(completions):
        row_tools = None if tools is None else tools[index]
        key = json.dumps(row_tools, sort_keys=True, default=str)
        if key not in registries:
            registries[key] = _registry_for(row_tools, executables) if row_tools else executables
        expected = None if tool is None else tool[index]
        cell = None if answer is None else answer[index]
        scores.append(_tool_task_score(completion, registries[key], expected, cell))
    return scores


tool_task.columns = frozenset({"answer"})


BUILTINS: dict[str, RewardFn] = {"length_window": length_window, "exact_answer": exact_answer,
                                 "json_tool_call": json_tool_call, "tool_task": tool_task}


def load_reward_fn(spec: str) -> tuple[str, RewardFn, float]:
    """``name``, the callable and its weight for ``module:function[@weight]`` or ``builtin[@weight]``."""
    target, _, weight_text = spec.partition("@")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise UserError(f"reward {spec}: weight {weight_text!r} is not a number (use module:function@0.5)") from None
    if target in BUILTINS:
        return target, BUILTINS[target], weight
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise UserError(f"reward {spec}: use module:function, or one of {', '.join(BUILTINS)}")
    try:
        fn = getattr(importlib.import_module(module_name), attribute)
    except ImportError as exc:
        raise UserError(f"reward {spec}: cannot import module {module_name} ({exc}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise UserError(f"reward {spec}: module {module_name} has no {attribute}") from None
    if not callable(fn):
        raise UserError(f"reward {spec}: {attribute} is not callable")
    return target, fn, weight


class LearnedReward:
    """The trained Bradley-Terry model as a reward function (loads alone from ``reward/model``)."""

    def __init__(self, path: Path, max_length: int = 256, batch_size: int = 16, device: str = "cpu"):
        from slm_align.reward.model import load_reward_model

        self.model, self.tokenizer = load_reward_model(path)
        self.model.to(device)
        self.max_length = max_length
        self.batch_size = batch_size

    def __call__(self, prompts, completions, truncated: Optional[Sequence[bool]] = None, **_) -> list[float]:
        """Scores of the texts; a completion flagged ``truncated`` (no EOS within the budget) is scored as written."""
        from slm_align.reward.model import score_texts

        return score_texts(self.model, self.tokenizer, list(prompts), list(completions), self.max_length,
                           self.batch_size, None if truncated is None else list(truncated))


@dataclass
class CombinedReward:
    """Weighted sum of named reward functions; :meth:`breakdown` keeps each term for logging."""

    terms: list[tuple[str, RewardFn, float]]

    def breakdown(self, prompts, completions, **context) -> dict[str, list[float]]:
        parts = {}
        for name, fn, _ in self.terms:
            scores = [float(s) for s in call_reward(fn, list(prompts), list(completions), **context)]
            if len(scores) != len(completions):
                raise UserError(f"reward {name} returned {len(scores)} scores for {len(completions)} completions")
            parts[name] = scores
        return parts

    def __call__(self, prompts, completions, **context) -> list[float]:
        parts = self.breakdown(prompts, completions, **context)
        weights = {name: weight for name, _, weight in self.terms}
        return [sum(weights[name] * parts[name][i] for name in parts) for i in range(len(completions))]


def combine(specs: Sequence[str] = (), learned: Optional[Path] = None, learned_weight: float = 1.0,
            callables: Sequence[tuple[RewardFn, float]] = (), device: str = "cpu") -> CombinedReward:
    """The learned model (when given, on ``device``), CLI specs and Python callables as one reward."""
    terms: list[tuple[str, RewardFn, float]] = []
    if learned is not None:
        terms.append(("reward_model", LearnedReward(learned, device=device), learned_weight))
    terms += [load_reward_fn(spec) for spec in specs]
    terms += [(getattr(fn, "__name__", type(fn).__name__), fn, weight) for fn, weight in callables]
    if not terms:
        raise UserError("no reward: train a reward model (`slm-align train --stage reward`) or pass --reward")
    return CombinedReward(terms)



# --- columns --------------------------------------------------------------------------------------


def _accepted(fn: RewardFn, context: dict) -> dict:
    """The keywords of ``context`` that ``fn`` takes (all of them when it has ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return context
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return context
    return {key: value for key, value in context.items() if key in parameters}


def call_reward(fn: RewardFn, prompts, completions, **context) -> Sequence[float]:
    """``fn(prompts, completions, **context)``, leaving out the keywords (columns) it does not take."""
    return fn(prompts, completions, **_accepted(fn, context))


def reward_name(fn: RewardFn) -> str:
    """A reward's name for messages: its function name, or its class name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


class ColumnReward:
    """A reward that receives, for each prompt, its task row's columns as keyword lists (see :func:`with_columns`).

    Other attributes (``terms`` of a :class:`CombinedReward`, ...) are the wrapped reward's.
    """

    def __init__(self, reward: RewardFn, tasks):
        self.reward = reward
        self.tasks = tasks
        self.__name__ = reward_name(reward)

    def __getattr__(self, name: str):
        if name in ("reward", "tasks") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.reward, name)

    def _context(self, prompts: list[str], context: dict) -> dict:
        columns = self.tasks.columns_for(prompts)
        clash = sorted(set(columns) & set(context))
        if clash:
            raise UserError(f"task column '{clash[0]}' has the name of an argument the trainer passes to rewards; "
                            "rename the column")
        return {**columns, **context}

    def __call__(self, prompts, completions, **context) -> Sequence[float]:
        """The wrapped reward's scores, given each prompt's columns as keyword lists besides ``context``."""
        prompts = list(prompts)
        return call_reward(self.reward, prompts, list(completions), **self._context(prompts, context))


class _ColumnRewardWithBreakdown(ColumnReward):
    def breakdown(self, prompts, completions, **context) -> dict[str, list[float]]:
        """The wrapped reward's per-term scores, given each prompt's columns."""
        prompts = list(prompts)
        return self.reward.breakdown(prompts, list(completions), **self._context(prompts, context))


def with_columns(reward_fn: RewardFn, tasks) -> ColumnReward:
    """``reward_fn`` called with each prompt's task columns (TRL's convention).

    ``tasks`` is a :class:`slm_align.data.tasks.TaskSet`; prompts may repeat (GRPO's groups) and come in any order
    or subset; each is looked up by its text, and one that is not in ``tasks`` is a UserError. The result calls
    ``reward_fn(prompts, completions, **columns, **context)`` (``context``: what the caller passes, such as
    ``truncated=``), leaving out columns a function without ``**kwargs`` does not take; ``breakdown`` stays
    available when ``reward_fn`` has one.
    """
    kind = _ColumnRewardWithBreakdown if hasattr(reward_fn, "breakdown") else ColumnReward
    return kind(reward_fn, tasks)


def _required_keywords(fn: RewardFn) -> set[str]:
    """Parameters without defaults after the first two positional ones (prompts, completions)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return set()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    skipped = {p.name for p in positional[:2]}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.name not in skipped and p.kind in named and p.default is p.empty}


def required_columns(reward_fn: RewardFn) -> set[str]:
    """The task columns a reward needs: its keyword parameters without defaults (besides prompts, completions and
    what callers pass, such as ``truncated``) and its ``columns`` attribute (the built-ins declare theirs); a
    :class:`CombinedReward` needs what its terms need."""
    if isinstance(reward_fn, ColumnReward):
        return required_columns(reward_fn.reward)
    if isinstance(reward_fn, CombinedReward):
        return set().union(*(required_columns(fn) for _, fn, _ in reward_fn.terms))
    if isinstance(reward_fn, functools.partial):
        return required_columns(reward_fn.func) - set(reward_fn.keywords)
    declared = getattr(reward_fn, "columns", None)
    names = set(declared) if isinstance(declared, (set, frozenset)) else set()
    return (names | _required_keywords(reward_fn)) - CONTEXT_KEYS


def _named_terms(reward_fn: RewardFn) -> list[tuple[str, RewardFn]]:
    if isinstance(reward_fn, ColumnReward):
        return _named_terms(reward_fn.reward)
    if isinstance(reward_fn, CombinedReward):
        return [(name, fn) for name, fn, _ in reward_fn.terms]
    return [(reward_name(reward_fn), reward_fn)]


def check_columns(reward_fn: RewardFn, available) -> None:
    """A one-line UserError naming each reward term whose columns the task data lacks, and the columns it has."""
    available = set(available)
    problems = []
    for name, fn in _named_terms(reward_fn):
        missing = sorted(required_columns(fn) - available)
        if missing:
            problems.append(f"reward {name} needs column{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    if problems:
        has = ", ".join(sorted(available)) or "none besides the prompt"
        raise UserError(f"{'; '.join(problems)}, which the task data lacks in some or all rows (its columns: {has}); "
                        "add them to every row or drop the reward")
