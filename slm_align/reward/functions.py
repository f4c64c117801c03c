"""Reward functions: anything that scores (prompt, completion) batches.

The protocol is a callable ``fn(prompts, completions, **context) -> list[float]``; ``context`` may carry
``references`` (reference answers, when the data has them) and, for sampled completions, ``truncated`` (one bool
each: the completion hit the token budget without EOS). Give one from the CLI as ``module:function``
(optionally ``module:function@weight``) or a built-in name; from Python, pass the callable. The learned reward
model is one such function (:class:`LearnedReward`), and :class:`CombinedReward` sums weighted terms.
"""

from __future__ import annotations

import importlib
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from slm_align.errors import UserError

RewardFn = Callable[..., Sequence[float]]


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


_ANSWER = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?|####)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)?")


def extract_answer(text: str) -> str:
    """The final answer in a completion: after "Answer:"/"####", else its last number, else the whole text."""
    found = _ANSWER.findall(text)
    if found:
        text = found[-1]
    else:
        numbers = _NUMBER.findall(text)
        text = numbers[-1] if numbers else text
    return " ".join(text.strip().strip(".").lower().split()).replace(",", "")


def exact_answer(prompts, completions, references: Optional[Sequence[Optional[str]]] = None, **_) -> list[float]:
    """1 when the completion's final answer equals the reference answer, else 0."""
    if references is None or len(references) != len(completions):
        raise UserError("the exact_answer reward needs reference answers: use data with prompt/completion rows")
    return [float(ref is not None and extract_answer(c) == extract_answer(ref))
            for c, ref in zip(completions, references)]


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


def json_tool_call(prompts, completions, schema: Optional[dict] = None, **_) -> list[float]:
    """1 for a JSON tool call ``{"name", "arguments"}`` valid against ``schema``; 0.5 for other JSON; else 0."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema or _CALL_SCHEMA)
    scores = []
    for completion in completions:
        call = _first_json_object(completion)
        if call is None:
            score = 0.0
        elif validator.is_valid(call):
            score = 1.0
        else:
            score = 0.5
        scores.append(score)
    return scores


BUILTINS: dict[str, RewardFn] = {"length_window": length_window, "exact_answer": exact_answer,
                                 "json_tool_call": json_tool_call}


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

    def __init__(self, path: Path, max_length: int = 256, batch_size: int = 16):
        from slm_align.reward.model import load_reward_model

        self.model, self.tokenizer = load_reward_model(path)
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
            scores = [float(s) for s in fn(list(prompts), list(completions), **context)]
            if len(scores) != len(completions):
                raise UserError(f"reward {name} returned {len(scores)} scores for {len(completions)} completions")
            parts[name] = scores
        return parts

    def __call__(self, prompts, completions, **context) -> list[float]:
        parts = self.breakdown(prompts, completions, **context)
        weights = {name: weight for name, _, weight in self.terms}
        return [sum(weights[name] * parts[name][i] for name in parts) for i in range(len(completions))]


def combine(specs: Sequence[str] = (), learned: Optional[Path] = None, learned_weight: float = 1.0,
            callables: Sequence[tuple[RewardFn, float]] = ()) -> CombinedReward:
    """The learned model (when given), CLI specs and Python callables as one reward."""
    terms: list[tuple[str, RewardFn, float]] = []
    if learned is not None:
        terms.append(("reward_model", LearnedReward(learned), learned_weight))
    terms += [load_reward_fn(spec) for spec in specs]
    terms += [(getattr(fn, "__name__", type(fn).__name__), fn, weight) for fn, weight in callables]
    if not terms:
        raise UserError("no reward: train a reward model (`slm-align train --stage reward`) or pass --reward")
    return CombinedReward(terms)


def spread(scores: Sequence[float]) -> float:
    """Population standard deviation of rewards (0 for fewer than two)."""
    return statistics.pstdev(scores) if len(scores) > 1 else 0.0
