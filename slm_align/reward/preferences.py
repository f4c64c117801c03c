"""Import preference data in TRL's conventions.

Accepted rows (any corpus format that :mod:`slm_align.data.readers` reads):

- paired: ``{prompt, chosen, rejected}`` with text values, or TRL's conversational form where ``chosen`` and
  ``rejected`` are message lists (``prompt`` a message list too, or left out when it is the shared prefix);
- unpaired: ``{prompt, completion, label}`` with a boolean label (text, or TRL's conversational form with message
  lists); within one prompt, every good completion is
  paired with every bad one (at most :data:`MAX_PAIRS_PER_PROMPT`).

This is also the format ``slm-align feedback export`` writes for the next round. Extra columns are ignored.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Union

from slm_align.data.prompts import chat_turn
from slm_align.data.readers import iter_rows
from slm_align.errors import UserError
from slm_align.reward.pairs import Pair

MAX_PAIRS_PER_PROMPT = 8


def _messages(where: str, value: Any, column: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                              and "role" in m for m in value):
        raise UserError(f"{where}: column '{column}' must be text or a list of {{role, content}} messages")
    return [(str(m["role"]), m["content"]) for m in value]


def _render_chat(where: str, row: dict, tokenizer) -> Pair:
    """A conversational pair as text: the prompt through the chat template, each answer as its last turn."""
    chosen = _messages(where, row["chosen"], "chosen")
    rejected = _messages(where, row["rejected"], "rejected")
    prompt = _messages(where, row["prompt"], "prompt") if "prompt" in row else chosen[:-1]
    if "prompt" not in row and chosen[:-1] != rejected[:-1]:
        raise UserError(f"{where}: without a 'prompt' column, chosen and rejected must share all but the last turn")
    prompt_text, chosen_text = chat_turn(prompt, chosen[-1], tokenizer)
    return Pair(prompt_text, chosen_text, chat_turn(prompt, rejected[-1], tokenizer)[1])


def _unpaired(where: str, row: dict, tokenizer) -> tuple[str, str]:
    """(prompt, completion) as text; TRL's conversational form goes through the chat template."""
    if isinstance(row["prompt"], list) or isinstance(row["completion"], list):
        completion = _messages(where, row["completion"], "completion")
        return chat_turn(_messages(where, row["prompt"], "prompt"), completion[-1], tokenizer)
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


def _rows(paths: list[Path]):
    for path in paths:
        yield from iter_rows(path)


def read_preferences(path: Union[Path, list[Path]], tokenizer=None) -> list[Pair]:
    """Every preference pair in ``path`` (or in several files read as one, so that unpaired rows of one prompt
    pair up across them); malformed rows are a UserError naming file and line."""
    paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
    path = ", ".join(map(str, paths))
    pairs: list[Pair] = []
    unpaired: dict[str, dict[bool, list[str]]] = defaultdict(lambda: {True: [], False: []})
    rows = 0
    for where, row in _rows(paths):
        rows += 1
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object, got {type(row).__name__}")
        if {"chosen", "rejected"} <= row.keys():
            if isinstance(row["chosen"], list) or isinstance(row["rejected"], list):
                pairs.append(_render_chat(where, row, tokenizer))
            else:
                pairs.append(Pair(_text(where, row, "prompt") if "prompt" in row else "",
                                  _text(where, row, "chosen"), _text(where, row, "rejected")))
        elif {"prompt", "completion", "label"} <= row.keys():
            prompt, completion = _unpaired(where, row, tokenizer)
            unpaired[prompt][_label(where, row["label"])].append(completion)
        else:
            raise UserError(f"{where}: a preference row needs prompt/chosen/rejected or prompt/completion/label "
                            f"(found: {', '.join(map(str, row)) or 'none'})")
    for prompt, by_label in unpaired.items():
        combos = [(good, bad) for good in by_label[True] for bad in by_label[False] if good != bad]
        pairs.extend(Pair(prompt, good, bad, "unpaired") for good, bad in combos[:MAX_PAIRS_PER_PROMPT])
    pairs = [p for p in pairs if p.chosen.strip() != p.rejected.strip()]
    if rows == 0:
        raise UserError(f"preferences {path} are empty; "
                        "give rows with prompt/chosen/rejected or prompt/completion/label")
    if not pairs:
        raise UserError(f"preferences {path} hold no usable pair (need chosen != rejected, or both a good and a bad "
                        "completion of one prompt)")
    return pairs
