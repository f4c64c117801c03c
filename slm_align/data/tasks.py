"""Task datasets for RL and evaluation: prompts the policy continues, each
with its row's other columns.

A row is ``{"prompt": "text", ...}`` (prompt-only, or prompt + ``answer``, ``solution``, anything),
a conversational prompt ``{"prompt": [{"role": "user", "content": ...}, ...], "tools": [...],
...}`` (TRL's convention) or ``{"messages": [...]}`` (a final assistant turn, as in SFT data, is
dropped). Conversations are rendered with the tokenizer's chat template (the default one when it
has none), with the row's ``tools`` and the assistant's generation prompt, so the prompt is exactly
the text the model continues.

Every column other than the prompt stays with its row: reward functions receive them as keyword
lists (``fn(prompts, completions, answer=[...], tools=[...])``, see
:func:`slm_align.ondevice.rewards.columns.with_columns`), which look a completion's row up by its
prompt. So two rows with the same rendered prompt must agree on their columns (identical rows
collapse to one), and :func:`split_tasks` keeps identical prompts on the same side.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Optional

from slm_align.data.splits import seeded_rank
from slm_align.errors import UserError
from slm_align.ondevice.rows import iter_rows
from slm_align.ondevice.templates.chat import (
    default_chat_template,
    shown_tools,
    template_form,
    template_traits,
)
from slm_align.ondevice.tools.specs import normalise_tools

RESERVED_COLUMNS = frozenset({"prompts", "completions"})


@dataclass(frozen=True)
class TaskSet:
    """Prompts as the policy continues them (rendered text) and, aligned with them,
    each row's other columns."""

    prompts: list[str]
    columns: list[dict[str, Any]]
    conversations: Optional[list[Optional[list[dict]]]] = None
    """Each row's prompt as the messages it was rendered from (None for a text prompt): what an
    agent episode starts from. None when no row is a conversation."""

    def __post_init__(self):
        if len(self.prompts) != len(self.columns):
            raise ValueError(f"TaskSet: {len(self.prompts)} prompts but "
                             f"{len(self.columns)} column rows")

    def conversation(self, prompt: str) -> list[dict]:
        """The messages a prompt was rendered from (a text prompt: one user message)."""
        index = self._row_of.get(prompt)
        if index is None:
            raise UserError(f"no task row has the prompt {_excerpt(prompt)}")
        found = self.conversations[index] if self.conversations is not None else None
        return found if found is not None else [{"role": "user", "content": prompt}]

    def row(self, prompt: str) -> dict[str, Any]:
        """The columns of the row whose prompt is ``prompt``."""
        index = self._row_of.get(prompt)
        if index is None:
            raise UserError(f"no task row has the prompt {_excerpt(prompt)}")
        return self.columns[index]

    def __len__(self) -> int:
        return len(self.prompts)

    def column_names(self) -> set[str]:
        """The columns every row has (with a value other than None)."""
        if not self.columns:
            return set()
        names = set(self.columns[0])
        for row in self.columns[1:]:
            names &= set(row)
        return {name for name in names if all(row[name] is not None for row in self.columns)}

    def all_column_names(self) -> list[str]:
        """Every column some row has, in first-seen order."""
        seen: dict[str, None] = {}
        for row in self.columns:
            seen.update(dict.fromkeys(row))
        return list(seen)

    def subset(self, indices: Iterable[int]) -> "TaskSet":
        """The rows at ``indices``, in that order."""
        chosen = list(indices)
        conversations = None
        if self.conversations is not None:
            conversations = [self.conversations[i] for i in chosen]
        return TaskSet([self.prompts[i] for i in chosen], [self.columns[i] for i in chosen],
                       conversations)

    @cached_property
    def _row_of(self) -> dict[str, int]:
        return {prompt: index for index, prompt in enumerate(self.prompts)}

    def columns_for(self, prompts: Iterable[str]) -> dict[str, list[Any]]:
        """Each column as a list aligned with ``prompts`` (repeats and any order allowed; None where
        a row lacks the column). A prompt that is not in the set is a UserError."""
        rows = []
        for prompt in prompts:
            index = self._row_of.get(prompt)
            if index is None:
                raise UserError(f"no task row has the prompt {_excerpt(prompt)} ({len(self)} "
                                "tasks); rewards can only score prompts of the task data they "
                                "were given")
            rows.append(self.columns[index])
        return {name: [row.get(name) for row in rows] for name in self.all_column_names()}


def _excerpt(text: str, limit: int = 60) -> str:
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


# --- reading --------------------------------------------------------------------------------------


def read_tasks(path, tokenizer=None, prompt_field: str = "prompt") -> TaskSet:
    """Task rows from a .jsonl, .json, .parquet file or a ``datasets`` directory
    (see the module docstring).

    Identical rows collapse to one; two rows with the same rendered prompt but different columns, a
    row without a prompt, or a conversation the chat template cannot render is a one-line UserError
    naming the row. ``tokenizer`` is needed only for conversational prompts.
    """
    prompts: list[str] = []
    columns: list[dict[str, Any]] = []
    conversations: list[Optional[list[dict]]] = []
    first_seen: dict[str, tuple[int, str]] = {}
    for where, row in iter_rows(Path(path)):
        prompt, other, messages = _task_row(where, row, tokenizer, prompt_field)
        if prompt in first_seen:
            _check_same_columns(where, first_seen[prompt], columns, other)
            continue
        first_seen[prompt] = (len(prompts), where)
        prompts.append(prompt)
        columns.append(other)
        conversations.append(messages)
    if not prompts:
        raise UserError(f"task data {path} holds no rows; give a file with one prompt per row")
    return TaskSet(prompts, columns, conversations if any(conversations) else None)


def _check_same_columns(where: str, first: tuple[int, str], columns: list[dict],
                        other: dict) -> None:
    index, first_where = first
    if columns[index] == other:
        return
    differing = sorted(key for key in set(columns[index]) | set(other)
                       if columns[index].get(key) != other.get(key))
    name = differing[0]
    raise UserError(
        f"{where}: same prompt as {first_where} but a different '{name}' "
        f"({_excerpt(columns[index].get(name), 30)} vs {_excerpt(other.get(name), 30)}); rewards "
        f"look a row's columns up by its prompt: keep one row per prompt"
    )


def _task_row(where: str, row: Any, tokenizer, prompt_field: str) -> tuple[str, dict[str, Any], Optional[list]]:
    """``(rendered prompt, other columns, the prompt's messages or None)`` of one row."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with a '{prompt_field}' column, got "
                        f"{type(row).__name__}")
    if prompt_field in row:
        field = prompt_field
    elif "messages" in row:
        field = "messages"
    else:
        found = ", ".join(map(str, row)) or "none"
        raise UserError(f"{where}: no '{prompt_field}' column (found: {found}); name the prompt "
                        "column with prompt_field, or give 'messages'")
    other = {key: value for key, value in row.items() if key != field}
    _check_column_names(where, other)
    if "tools" in other:
        other["tools"] = normalise_tools(where, other["tools"])
    value = row[field]
    if isinstance(value, str):
        return _text_prompt(where, field, value), other, None
    messages = _conversation(where, field, value)
    return render_conversation(where, messages, other.get("tools"), tokenizer), other, messages


def _check_column_names(where: str, columns: dict) -> None:
    clash = sorted(RESERVED_COLUMNS & set(columns))
    if clash:
        raise UserError(f"{where}: column '{clash[0]}' clashes with the reward functions' own "
                        f"argument; rename it")


def _text_prompt(where: str, field: str, value: str) -> str:
    if not value.strip():
        raise UserError(f"{where}: column '{field}' is empty; every task needs a prompt")
    return value


def _conversation(where: str, field: str, value: Any) -> list[dict]:
    """The messages of a conversational prompt, checked; a final assistant turn is dropped."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: '{field}' must be text or a non-empty list of "
                        f"{{role, content}} messages")
    messages = []
    for message in value:
        _check_message(where, field, message)
        messages.append({key: item for key, item in message.items() if item is not None})
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise UserError(f"{where}: '{field}' holds only an assistant turn; a task "
                        "needs the turns it answers")
    return messages


def _check_message(where: str, field: str, message: Any) -> None:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise UserError(f"{where}: each message in '{field}' needs a 'role' and a text 'content'")
    content = message.get("content")
    if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
        raise UserError(f"{where}: a {message['role']} message in '{field}' has no text 'content' "
                        f"(got {type(content).__name__})")


def render_conversation(where: str, messages: list[dict], tools: Optional[list[dict]],
                        tokenizer) -> str:
    """The messages (and tools) through the tokenizer's chat template, ending with
    the generation prompt."""
    if tokenizer is None:
        raise UserError(f"{where}: a conversational prompt needs a tokenizer to render it "
                        "with its chat template")
    template = tokenizer.chat_template or default_chat_template(tokenizer)
    try:
        formed = shown_tools(template, template_form(messages, template_traits(template)), tools)
        return tokenizer.apply_chat_template(formed, tools=tools or None,
                                             add_generation_prompt=True, tokenize=False,
                                             chat_template=template)
    except Exception as exc:
        # jinja2 and transformers raise several types for a conversation a template refuses
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"{where}: the chat template cannot render this conversation "
                        f"({type(exc).__name__}: {reason})") from None


# --- splitting ------------------------------------------------------------------------------------


def split_tasks(tasks: TaskSet, seed: int, heldout_fraction: float, max_heldout: int) -> tuple[TaskSet, TaskSet]:
    """``(train, heldout)`` by a seeded hash of each prompt, so identical prompts
    always land on the same side.

    The held-out part gets ``heldout_fraction`` of the distinct prompts (at least one when
    the fraction is above 0), at most ``max_heldout``, and never all of them. Rows keep
    their order within each part.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise UserError(f"heldout fraction must be in [0, 1), got {heldout_fraction}")
    distinct = list(dict.fromkeys(tasks.prompts))
    wanted = min(max_heldout, round(len(distinct) * heldout_fraction))
    if heldout_fraction > 0 and max_heldout > 0:
        wanted = max(1, wanted)
    if wanted >= len(distinct) and wanted > 0:
        raise UserError(f"the task data has {len(distinct)} distinct prompt(s); need more than "
                        f"{wanted} to hold {wanted} out and still train on some")
    ranked = sorted(distinct, key=lambda prompt: seeded_rank(seed, prompt))
    heldout = set(ranked[:wanted])
    train_rows = [i for i, prompt in enumerate(tasks.prompts) if prompt not in heldout]
    heldout_rows = [i for i, prompt in enumerate(tasks.prompts) if prompt in heldout]
    return tasks.subset(train_rows), tasks.subset(heldout_rows)
