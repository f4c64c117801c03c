"""Final answers: read a completion's answer and compare it with a reference (numbers by value), and
the ``exact_answer`` reward built on that rule.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

from slm_align.errors import UserError

_ANSWER = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?|####)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_NUMERIC = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def extract_answer(text: str) -> str:
    """The final answer in a completion: after "Answer:"/"####", else its last
    number, else the whole text."""
    found = _ANSWER.findall(text)
    if found:
        text = found[-1]
    else:
        numbers = _NUMBER.findall(text)
        text = numbers[-1] if numbers else text
    return normalise_answer(text)


def normalise_answer(text: Any) -> str:
    """Lower case, single spaces, no trailing period and no thousands commas
    (``"1,000."`` is ``"1000"``)."""
    return " ".join(str(text).strip().strip(".").lower().split()).replace(",", "")


def _as_number(text: str) -> Optional[float]:
    """The value of a normalised answer that is a plain number, else None."""
    return float(text) if _NUMERIC.fullmatch(text) else None


def same_answer(candidate: Any, reference: Any) -> bool:
    """True when the two answers are equal once normalised, or are numbers with equal
    values (350 and 350.0)."""
    left = normalise_answer(candidate)
    right = normalise_answer(reference)
    if left == right:
        return True
    a = _as_number(left)
    b = _as_number(right)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _reference_of(answer: Any) -> Optional[str]:
    """An ``answer`` cell as a normalised answer: the text after "####"/"Answer:" when it has one
    (GSM8K's solutions do), else the whole cell."""
    if answer is None:
        return None
    found = _ANSWER.findall(str(answer))
    return normalise_answer(found[-1] if found else answer)


def final_answer_matches(completion: str, reference: str) -> bool:
    """Whether a completion's final answer is ``reference`` (normalised).

    After an "Answer:"/"####" marker the text there (or its first number) must equal it;
    without a marker a numeric reference is compared with the completion's last number, and a
    text one must end the completion.
    """
    found = _ANSWER.findall(completion)
    if found:
        numbers = _NUMBER.findall(found[-1])
        return same_answer(found[-1], reference) or bool(numbers
                                                         and same_answer(numbers[0], reference))
    if _as_number(reference) is not None:
        numbers = _NUMBER.findall(completion)
        return bool(numbers) and same_answer(numbers[-1], reference)
    text = normalise_answer(completion)
    return text == reference or bool(re.search(rf"(?<!\w){re.escape(reference)}$", text))


def exact_answer(prompts, completions, answer: Optional[Sequence[Any]] = None,
                 references: Optional[Sequence[Optional[str]]] = None, **_) -> list[float]:
    """1 when the completion's final answer equals the row's ``answer`` column, else 0.

    Numbers compare by value (``350`` equals ``350.0``, ``1,000`` equals ``1000``); see
    :func:`final_answer_matches`. ``references=`` (reference completions, whose own final answer
    counts) is the older way to give the answers and still works.
    """
    if answer is not None:
        wanted = [_reference_of(cell) for cell in answer]
    elif references is not None:
        wanted = [None if ref is None else extract_answer(ref) for ref in references]
    else:
        raise UserError("the exact_answer reward needs reference answers: give task data "
                        "with an 'answer' column")
    if len(wanted) != len(completions):
        raise UserError(f"the exact_answer reward got {len(wanted)} answers for "
                        f"{len(completions)} completions")
    return [float(ref is not None and final_answer_matches(c, ref))
            for c, ref in zip(completions, wanted)]



exact_answer.columns = frozenset({"answer"})
exact_answer.bounds = (0.0, 1.0)  # worst and best score (the gate reads them)
