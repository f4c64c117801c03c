"""A bundled tool-use task, generated (no download): arithmetic and unit questions
the calculator tool answers.

Every task row follows TRL's conventional columns::

    {"prompt": [{"role": "user", "content": "What is 17 * 23?"}],
     "tools": [<calculator's OpenAI schema>], "answer": "391", "tool": "calculator", "expression": "17 * 23"}

``answer`` is exactly the text the runtime's calculator returns for ``expression``, so a model that
calls the tool and copies its observation is right. SFT rows teach the format as chat ``messages``:
the user's question, the assistant's tool call (the Hermes text :meth:`ToolRegistry.parse_calls`
reads), the tool's observation, and the final answer; they render through a chat template to the
same text the agent runtime renders for that conversation.

The SFT chats may also hold a teacher's habit: with ``memory_share`` above zero, that share of the
training tasks is demonstrated as a direct answer without the tool (right, as a teacher who can
multiply answers). A small student copies the habit and cannot carry it out; reinforcement learning
on task success in the runtime is what teaches it that calling the tool pays (the quickstart shows
it).

Generation is seeded and deterministic; train and held-out tasks share no question and no expression
(``a * b`` and ``b * a`` count as one).
"""

from __future__ import annotations

import random
from decimal import Decimal
from pathlib import Path
from typing import Callable, Optional

from slm_align.atomic import jsonl_text, write_text_atomic
from slm_align.errors import UserError
from slm_align.ondevice.tools.builtin import calculator, default_tools
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.parse import call_text

TOOL = "calculator"
FILES = ("sft", "train", "heldout")

_ARITHMETIC = {
    "+": ("What is {a} + {b}?",
          "What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
          "Calculate {a} + {b}."),
    "-": ("What is {a} - {b}?",
          "What is {a} minus {b}?", "Subtract {b} from {a}.", "Calculate {a} - {b}.",
          "What do you get when you take {b} away from {a}?"),
    "*": ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.",
          "What is the product of {a} and {b}?", "Calculate {a} * {b}."),
    "/": ("What is {a} / {b}?",
          "What is {a} divided by {b}?", "Divide {a} by {b}.", "Calculate {a} / {b}."),
}
_UNIT_TEMPLATES = ("How many {small} are in {q} {large}?", "Convert {q} {large} to {small}.",
                   "{q} {large} is how many {small}?", "What is {q} {large} in {small}?",
                   "How many {small} make {q} {large}?")
_UNITS = (("metres", "centimetres", 100), ("kilometres", "metres", 1000), ("hours", "minutes", 60),
          ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("litres", "millilitres", 1000),
          ("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12),
          ("metres", "millimetres", 1000))
UNIT_SHARE = 0.4
"""Share of unit questions among the generated tasks (the rest is arithmetic)."""


def calculator_schema() -> dict:
    """The calculator's OpenAI function schema, as the runtime's ToolRegistry lists it."""
    return default_tools().get(TOOL).spec()


def tool_call_text(expression: str) -> str:
    """The assistant's call, in the Hermes format the runtime parses (and
    its GBNF grammar allows)."""
    return call_text([ToolCall(TOOL, {"expression": expression})])


def final_answer_text(answer: str) -> str:
    """The assistant's last turn after the observation: a short sentence ending with the number."""
    return f"The answer is {answer}."


def _number_text(value: Decimal) -> str:
    """A decimal as the calculator writes it: whole numbers without a point, others
    without trailing zeros."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    """Two- or three-digit operands; differences stay positive and quotients whole."""
    if op == "/":
        divisor = rng.randint(2, 19)
        return divisor * rng.randint(2, 50), divisor
    if op == "*":
        return rng.randint(11, 99), rng.randint(11, 99)
    first = rng.randint(100, 999) if rng.random() < 0.4 else rng.randint(10, 99)
    second = rng.randint(10, 99)
    if op == "-" and second >= first:
        first = first + second
    return first, second


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, canonical key) of one arithmetic task."""
    op = rng.choice(sorted(_ARITHMETIC))
    first, second = _operands(rng, op)
    question = rng.choice(_ARITHMETIC[op]).format(a=first, b=second)
    expression = f"{first} {op} {second}"
    return question, expression, _key(str(first), op, str(second))


def _unit(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, canonical key) of one unit conversion task."""
    large, small, factor = rng.choice(_UNITS)
    if rng.random() < 0.3:
        quantity = f"{rng.randint(1, 9)}.5"
    else:
        quantity = str(rng.randint(2, 99))
    question = rng.choice(_UNIT_TEMPLATES).format(q=quantity, large=large, small=small)
    question = question[0].upper() + question[1:]
    expression = f"{quantity} * {factor}"
    return question, expression, _key(quantity, "*", str(factor))


def _key(first: str, op: str, second: str) -> str:
    """The expression with commutative operands sorted: what may not appear on
    both sides of the split."""
    if op in "+*":
        low, high = sorted((Decimal(first), Decimal(second)))
        return f"{low} {op} {high}"
    return f"{first} {op} {second}"


def expected_answer(expression: str) -> str:
    """The exact value of ``a op b`` (decimal arithmetic, no floats), written as
    the calculator writes it."""
    first, op, second = expression.split()
    operations: dict[str, Callable[[Decimal, Decimal], Decimal]] = {
        "+": Decimal.__add__, "-": Decimal.__sub__, "*": Decimal.__mul__, "/": Decimal.__truediv__,
    }
    return _number_text(operations[op](Decimal(first), Decimal(second)))


def task_row(question: str, expression: str) -> dict:
    """One task row: the chat prompt, the calculator's schema, the verifiable answer,
    the tool and expression."""
    answer = expected_answer(expression)
    observed = calculator(expression)
    if observed != answer:  # the observation is what the model copies: they must agree
        raise AssertionError(f"calculator({expression!r}) gave {observed!r}, expected {answer!r}")
    return {"prompt": [{"role": "user", "content": question}], "tools": [calculator_schema()],
            "answer": answer, "tool": TOOL, "expression": expression}


def make_tasks(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct task rows (no two share a question or an expression), the
    same for the same seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    questions: set[str] = set()
    rows = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise UserError(f"cannot generate {n} distinct tasks; ask for fewer "
                            "(a few thousand at most)")
        if rng.random() < UNIT_SHARE:
            question, expression, key = _unit(rng)
        else:
            question, expression, key = _arithmetic(rng)
        if key in seen or question in questions:
            continue
        seen.add(key)
        questions.add(question)
        rows.append(task_row(question, expression))
    return rows


def split_tasks(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and held-out task rows; every task is distinct, so no question or
    expression is on both sides."""
    if n_train < 1 or n_heldout < 0:
        raise UserError("--train must be at least 1 and --heldout at least 0 (got "
                        f"{n_train} and {n_heldout})")
    rows = make_tasks(n_train + n_heldout, seed)
    random.Random(seed + 1).shuffle(rows)
    return rows[:n_train], rows[n_train:]


def sft_rows(task: dict) -> list[dict]:
    """Two chat rows teaching one task: the question -> the tool call; and after the
    observation -> the answer.

    In OpenAI's form, as the runtime stores a conversation: the call once, in the assistant's
    ``tool_calls``; the tool message with the name and content the runtime's :class:`Observation`
    gives; the task's tools beside the messages. A chat template renders the call its own way
    (its text in the content for ChatML and SmolLM2, ``tool_calls`` for Qwen2.5: see
    :func:`slm_align.ondevice.templates.chat.template_form`).
    """
    question = task["prompt"]
    call = ToolCall(task["tool"], {"expression": task["expression"]})
    turn = {"role": "assistant", "content": "", "tool_calls": [call.as_dict()]}
    observation = {"role": "tool", "name": task["tool"], "content": calculator(task["expression"])}
    final = {"role": "assistant", "content": final_answer_text(task["answer"])}
    tools = task["tools"]
    return [{"messages": question + [turn], "tools": tools},
            {"messages": question + [turn, observation, final], "tools": tools}]


def memory_row(task: dict) -> dict:
    """A chat row answering ``task`` at once, without the tool: the teacher's answer from memory."""
    final = {"role": "assistant", "content": final_answer_text(task["answer"])}
    return {"messages": task["prompt"] + [final], "tools": task["tools"]}


def sft_chats(train: list[dict], memory_share: float = 0.0, seed: int = 0) -> list[dict]:
    """The SFT chats of ``train``: two tool-use rows per task (:func:`sft_rows`), except for a
    ``memory_share`` of the tasks (drawn with ``seed``) answered from memory
    (:func:`memory_row`)."""
    if not 0.0 <= memory_share <= 1.0:
        raise UserError(f"--memory-share must be between 0 and 1 (got {memory_share})")
    rng = random.Random(seed + 2)
    rows = []
    for task in train:
        if rng.random() < memory_share:
            rows.append(memory_row(task))
        else:
            rows.extend(sft_rows(task))
    return rows


def write_agent_tasks(out_dir, n_train: int = 400, n_heldout: int = 100, seed: int = 0,
                      overwrite: bool = False, memory_share: float = 0.0) -> dict[str, Path]:
    """Write ``sft.jsonl`` (format-teaching chats, :func:`sft_chats`), ``train.jsonl`` (RL task
    rows) and ``heldout.jsonl`` (evaluation task rows) into ``out_dir``; returns their paths keyed
    ``sft``, ``train``, ``heldout``."""
    out = Path(out_dir)
    paths = {name: out / f"{name}.jsonl" for name in FILES}
    existing = [str(path) for path in paths.values() if path.exists()]
    if existing and not overwrite:
        raise UserError(f"{', '.join(existing)} already exist; choose another "
                        "--out or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    train, heldout = split_tasks(n_train, n_heldout, seed)
    chats = sft_chats(train, memory_share, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(paths["sft"], jsonl_text(chats))
    write_text_atomic(paths["train"], jsonl_text(train))
    write_text_atomic(paths["heldout"], jsonl_text(heldout))
    return paths


def leak_keys(rows: list[dict]) -> set[str]:
    """Every question and canonical expression of ``rows``."""
    found = set()
    for row in rows:
        first, op, second = row["expression"].split()
        found.add(_key(first, op, second))
        found.add(row["prompt"][-1]["content"])
    return found


def leaks(train: list[dict], heldout: list[dict]) -> Optional[str]:
    """A question or expression found on both sides of a split (None when there is none)."""
    shared = leak_keys(train) & leak_keys(heldout)
    return min(shared) if shared else None
