"""Import preference data in TRL's conventions.

Accepted rows (any corpus format that :mod:`slm_align.data.readers` reads):

- paired: ``{prompt, chosen, rejected}`` with text values, or TRL's conversational form where
  ``chosen`` and ``rejected`` are message lists (``prompt`` a message list too, or left out when
  it is the shared prefix);
- unpaired: ``{prompt, completion, label}`` with a boolean label (text, or TRL's conversational form
  with message lists); within one prompt, every good completion is paired with every bad one (at
  most :data:`MAX_PAIRS_PER_PROMPT`).

A ``tools`` column (TRL's: the tools the prompt offered, a list or JSON text) renders the prompt
with them, as the runtime showed them. This is also the format ``slm-align feedback export`` writes
for the next round. Other extra columns are ignored.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from slm_align.data.pairs import Pair
from slm_align.data.prompts import chat_message, chat_turn
from slm_align.errors import UserError
from slm_align.ondevice.rows import iter_rows
from slm_align.ondevice.tools.specs import normalise_tools

MAX_PAIRS_PER_PROMPT = 8


def _messages(where: str, value: Any, column: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: column '{column}' must be text or a list of "
                        f"{{role, content}} messages")
    return [chat_message(f"{where}: column '{column}'", message) for message in value]


def _render_chat(where: str, row: dict, tokenizer) -> Pair:
    """A conversational pair as text: the prompt through the chat template, each
    answer as its last turn."""
    chosen = _messages(where, row["chosen"], "chosen")
    rejected = _messages(where, row["rejected"], "rejected")
    prompt = _messages(where, row["prompt"], "prompt") if "prompt" in row else chosen[:-1]
    if "prompt" not in row and chosen[:-1] != rejected[:-1]:
        raise UserError(f"{where}: without a 'prompt' column, chosen and rejected must "
                        "share all but the last turn")
    tools = normalise_tools(where, row.get("tools"))
    prompt_text, chosen_text = chat_turn(prompt, chosen[-1], tokenizer, tools)
    return Pair(prompt_text, chosen_text, chat_turn(prompt, rejected[-1], tokenizer, tools)[1])


def _unpaired(where: str, row: dict, tokenizer) -> tuple[str, str]:
    """(prompt, completion) as text; TRL's conversational form goes through the chat template."""
    if isinstance(row["prompt"], list) or isinstance(row["completion"], list):
        completion = _messages(where, row["completion"], "completion")
        tools = normalise_tools(where, row.get("tools"))
        return chat_turn(_messages(where, row["prompt"], "prompt"), completion[-1], tokenizer,
                         tools)
    return _text(where, row, "prompt"), _text(where, row, "completion")


def _text(where: str, row: dict, column: str) -> str:
    value = row[column]
    if not isinstance(value, str):
        raise UserError(f"{where}: column '{column}' holds {type(value).__name__}, expected text")
    return value


def _label(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise UserError(f"{where}: 'label' must be true or false, got {value!r}")


def _paths(path: Union[Path, list[Path]]) -> list[Path]:
    """One path or several, as a list."""
    if isinstance(path, (list, tuple)):
        return [Path(p) for p in path]
    return [Path(path)]


def _rows(paths: list[Path]):
    for path in paths:
        yield from iter_rows(path)


@dataclass(frozen=True)
class Labelled:
    """One unpaired verdict: ``completion`` of ``prompt`` is good (``label`` True) or bad."""

    prompt: str
    completion: str
    label: bool


@dataclass
class PreferenceRows:
    """Every row of some preference files as read: pairs, unpaired verdicts, and the
    ``model_id`` column's values (the sha256 of the artifact each piece of feedback was given
    to, written by ``feedback export``)."""

    pairs: list[Pair] = field(default_factory=list)
    labelled: list[Labelled] = field(default_factory=list)
    model_ids: set[str] = field(default_factory=set)

    def paired(self) -> list[Pair]:
        """The pairs, then every good completion of a prompt paired with every bad one (at most
        :data:`MAX_PAIRS_PER_PROMPT` per prompt)."""
        by_prompt: dict[str, dict[bool, list[str]]] = defaultdict(lambda: {True: [], False: []})
        for item in self.labelled:
            by_prompt[item.prompt][item.label].append(item.completion)
        pairs = list(self.pairs)
        for prompt, by_label in by_prompt.items():
            combos = [(good, bad) for good in by_label[True] for bad in by_label[False]
                      if good != bad]
            pairs.extend(Pair(prompt, good, bad, "unpaired")
                         for good, bad in combos[:MAX_PAIRS_PER_PROMPT])
        return [p for p in pairs if p.chosen.strip() != p.rejected.strip()]

    def unpaired(self) -> list[Labelled]:
        """The unpaired verdicts, then each pair as a good and a bad completion
        (TRL's conversion for KTO)."""
        split = [Labelled(p.prompt, p.chosen, True) for p in self.pairs]
        split += [Labelled(p.prompt, p.rejected, False) for p in self.pairs]
        return self.labelled + split


def _read_row(where: str, row: Any, tokenizer, rows: PreferenceRows) -> None:
    """Add one file row to ``rows`` (a pair or a verdict); a malformed row is a
    UserError naming file and line."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object, got {type(row).__name__}")
    if {"chosen", "rejected"} <= row.keys():
        if isinstance(row["chosen"], list) or isinstance(row["rejected"], list):
            rows.pairs.append(_render_chat(where, row, tokenizer))
        else:
            prompt = _text(where, row, "prompt") if "prompt" in row else ""
            rows.pairs.append(Pair(prompt, _text(where, row, "chosen"),
                                   _text(where, row, "rejected")))
    elif {"prompt", "completion", "label"} <= row.keys():
        prompt, completion = _unpaired(where, row, tokenizer)
        rows.labelled.append(Labelled(prompt, completion, _label(where, row["label"])))
    else:
        raise UserError(f"{where}: a preference row needs prompt/chosen/rejected or "
                        f"prompt/completion/label (found: {', '.join(map(str, row)) or 'none'})")
    if isinstance(row.get("model_id"), str):
        rows.model_ids.add(row["model_id"])


def read_preference_rows(path: Union[Path, list[Path]], tokenizer=None) -> PreferenceRows:
    """Every row of ``path`` (or of several files read as one); empty input is a UserError."""
    paths = _paths(path)
    rows = PreferenceRows()
    count = 0
    for where, row in _rows(paths):
        count += 1
        _read_row(where, row, tokenizer, rows)
    if count == 0:
        raise UserError(f"preferences {', '.join(map(str, paths))} are empty; "
                        "give rows with prompt/chosen/rejected or prompt/completion/label")
    return rows


def read_preferences(path: Union[Path, list[Path]], tokenizer=None) -> list[Pair]:
    """Every preference pair in ``path`` (or in several files read as one, so that unpaired rows of
    one prompt pair up across them); malformed rows are a UserError naming file and line."""
    pairs = read_preference_rows(path, tokenizer).paired()
    if not pairs:
        paths = _paths(path)
        raise UserError(f"preferences {', '.join(map(str, paths))} hold no usable pair (need "
                        "chosen != rejected, or both a good and a bad completion of one prompt)")
    return pairs
