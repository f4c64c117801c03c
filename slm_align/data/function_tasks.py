"""The function-calling task family (``tasks make --kind functions``): rows in BFCL's categories
over the generated library (:mod:`slm_align.data.function_library`), split by function, and SFT
chats.

A row (the format ``function_call_match`` and ``evaluate-agent`` read)::

    {"id": "functions_train_simple_0001", "category": "simple",
     "messages": [{"role": "user", "content": "Wake me at 6:30 am for gym."}],
     "tools": [{"type": "function", "function": {"name": "clock_alarm_add", ...}}],
     "ground_truth": [{"clock_alarm_add": {"time": ["06:30"], "label": ["gym"], ...}}]}

Categories, as BFCL's: ``simple`` (one function offered, one call), ``multiple`` (one call, several
functions offered: distractors of the same domain first), ``parallel`` (several calls of one
function in one request), ``parallel_multiple`` (calls of several functions) and ``irrelevance``
(no offered function fits: ``ground_truth`` is ``[]``, the right answer is text).

The held-out split holds functions that no training row offers or asks for (a seeded quarter of each
domain's functions); ``sft.jsonl`` holds each training row as a chat whose assistant turn makes the
calls in ``tool_calls`` (the runtime's form) or, for irrelevance, says in a sentence that no
function fits. Everything is seeded: the same seed writes the same files.

Twins (``twins=True``, ``tasks make --kind functions --twins``): each irrelevance row of the
training split gets a twin, a ``multiple`` row with the same request, the same offered functions
plus the one the request is for (at a seeded place), and that request's ground truth: the same
words need a call or a sentence depending on what is offered, so a model must read the offered
functions. A twin follows or precedes its irrelevance row (seeded), so the first N rows (the few
demonstrations) hold both halves of a pair. The twins take the place of as many rows of the call
categories (shared out among them by the mix): the training split keeps its size and its share of
irrelevance rows. The held-out split never has twins; with twins off nothing changes.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Optional

from slm_align.atomic import jsonl_text, write_text_atomic
from slm_align.data.function_library import draw_request, library, tool_schema
from slm_align.errors import UserError
from slm_align.ondevice.tools.calls import ToolCall

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
DEFAULT_MIX = {"simple": 0.3, "multiple": 0.2, "parallel": 0.15, "parallel_multiple": 0.15,
               "irrelevance": 0.2}
"""Share of each category among the rows of a split (BFCL's non-live categories weigh about so)."""
HELDOUT_SHARE = 0.25
"""Share of each domain's functions kept for the held-out split."""
MAX_TRAIN = 20000
MAX_HELDOUT = 5000
FILES = ("sft", "train", "heldout")
_JOINERS = ("Also, ", "And ", "Then ", "After that, ", "Next, ")
_DECLINES = ("None of the functions I have can do that, sorry.",
             "I can't help with that using the tools available to me.",
             "Sorry, none of my available functions handles that request.",
             "That is not something the offered tools can do.")


def split_functions(seed: int, share: float = HELDOUT_SHARE) -> tuple[list[dict], list[dict]]:
    """(training, held-out) functions: a seeded ``share`` of each domain's functions is held out."""
    rng = random.Random(seed)
    train, heldout = [], []
    for domain in sorted({function["domain"] for function in library()}):
        members = [function for function in library() if function["domain"] == domain]
        rng.shuffle(members)
        cut = max(1, round(share * len(members)))
        heldout.extend(members[:cut])
        train.extend(members[cut:])
    return train, heldout


def category_counts(n: int, mix: Optional[dict] = None) -> dict[str, int]:
    """``n`` rows shared out by ``mix`` (largest remainders: the counts add up to ``n``)."""
    mix = DEFAULT_MIX if mix is None else mix
    total = sum(mix.values())
    exact = {category: n * mix.get(category, 0.0) / total for category in CATEGORIES}
    counts = {category: int(value) for category, value in exact.items()}
    by_remainder = sorted(CATEGORIES, key=lambda category: counts[category] - exact[category])
    for category in by_remainder[: n - sum(counts.values())]:
        counts[category] += 1
    return counts


def _same_domain_first(anchor: dict, pool: list[dict], k: int, rng: random.Random) -> list[dict]:
    """``k`` functions of ``pool`` other than ``anchor``: of its domain first, then of others."""
    near = [function for function in pool
            if function["domain"] == anchor["domain"] and function is not anchor]
    far = [function for function in pool if function["domain"] != anchor["domain"]]
    rng.shuffle(near)
    rng.shuffle(far)
    return (near + far)[:k]


def repeatable(function: dict) -> bool:
    """Whether one request may call ``function`` several times: not marked ``once`` and not a switch
    (a required boolean: "turn it on, and turn it off" is no request)."""
    switches = [name for name in function["required"]
                if function["params"][name]["type"] == "boolean"]
    return not function.get("once") and not switches


def _distinct_requests(function: dict, k: int, rng: random.Random) -> list:
    """``k`` requests for ``function`` that differ in their first required argument (several calls
    act on different things)."""
    first = function["required"][0]
    requests: dict[str, object] = {}
    for _ in range(20 * k):
        request = draw_request(function, rng)
        key = json.dumps(request.truth[function["name"]][first], sort_keys=True)
        requests.setdefault(key, request)
        if len(requests) == k:
            break
    return list(requests.values())


def _joined(requests: list, rng: random.Random) -> str:
    """Several requests as one message: "A. Also, b." (a name or "I" keeps its capital)."""
    sentences = [request.text if request.text[-1] in ".?!" else request.text + "."
                 for request in requests]
    out = sentences[0]
    for request, sentence in zip(requests[1:], sentences[1:]):
        first = sentence.split(" ", 1)[0]
        if not request.opens_with_name and first[1:].islower() and first != "I":
            sentence = sentence[0].lower() + sentence[1:]
        out += " " + rng.choice(_JOINERS) + sentence
    return out


def _row(category: str, requests: list, offered: list[dict], rng: random.Random) -> dict:
    rng.shuffle(offered)
    return {"category": category,
            "messages": [{"role": "user", "content": _joined(requests, rng)}],
            "tools": [tool_schema(function) for function in offered],
            "ground_truth": [request.truth for request in requests]}


def make_row(category: str, functions: list[dict], rng: random.Random) -> dict:
    """One row of ``category`` over ``functions`` (the split's functions)."""
    anchor = rng.choice(functions)
    if category == "parallel":
        anchor = rng.choice([function for function in functions if repeatable(function)])
        return _row(category, _distinct_requests(anchor, rng.randint(2, 3), rng), [anchor], rng)
    if category == "simple":
        return _row(category, [draw_request(anchor, rng)], [anchor], rng)
    if category == "multiple":
        offered = [anchor, *_same_domain_first(anchor, functions, rng.randint(1, 3), rng)]
        return _row(category, [draw_request(anchor, rng)], offered, rng)
    if category == "parallel_multiple":
        called = [anchor, *_same_domain_first(anchor, functions, rng.randint(1, 2), rng)]
        requests = [request for function in called
                    for request in _distinct_requests(function,
                                                      1 + (repeatable(function)
                                                           and rng.random() < 0.3),
                                                      rng)]
        rng.shuffle(requests)
        offered = called + _same_domain_first(anchor, [f for f in functions if f not in called],
                                              rng.randint(0, 1), rng)
        return _row(category, requests, offered, rng)
    return _irrelevance_row(anchor, functions, rng)


def _irrelevance_row(anchor: dict, functions: list[dict], rng: random.Random) -> dict:
    """Functions of ``anchor``'s domain offered, a request for a function of an unrelated group."""
    return _irrelevance_pair(anchor, functions, rng)[0]


def _irrelevance_pair(anchor: dict, functions: list[dict],
                      rng: random.Random) -> tuple[dict, dict, object]:
    """An irrelevance row (:func:`_irrelevance_row`), the function its request is for and the
    request (what its twin needs)."""
    offered = [anchor, *[function for function in _same_domain_first(anchor, functions, 2, rng)
                         if function["domain"] == anchor["domain"]][: rng.randint(0, 2)]]
    unrelated = [function for function in functions if function["group"] != anchor["group"]]
    asked = rng.choice(unrelated)
    request = draw_request(asked, rng)
    row = _row("irrelevance", [request], offered, rng)
    row["ground_truth"] = []
    return row, asked, request


def twin_row(irrelevance: dict, asked: dict, request, rng: random.Random) -> dict:
    """The twin of an irrelevance row: its request and offered functions with ``asked`` (the
    function the request is for) put at a seeded place among them; ground truth the request's
    (category ``multiple``: an irrelevance row offers at least one function)."""
    tools = copy.deepcopy(irrelevance["tools"])
    tools.insert(rng.randint(0, len(tools)), tool_schema(asked))
    return {"category": "multiple", "messages": copy.deepcopy(irrelevance["messages"]),
            "tools": tools, "ground_truth": [request.truth]}


def twin_counts(counts: dict[str, int], mix: Optional[dict] = None) -> dict[str, int]:
    """The counts of :func:`category_counts` with room for one twin per irrelevance row: the call
    categories give up as many rows, shared out among them by ``mix`` (largest remainders)."""
    mix = DEFAULT_MIX if mix is None else mix
    pairs = counts["irrelevance"]
    left = sum(counts.values()) - 2 * pairs
    if left < 0:
        raise UserError(f"--twins gives each of the {pairs} irrelevance rows a twin, more rows than "
                        "the split holds; lower the irrelevance share to at most half")
    calls = {category: mix.get(category, 0.0) for category in CATEGORIES[:-1]}
    shared = category_counts(left, calls) if left and sum(calls.values()) else {}
    return {category: shared.get(category, 0) for category in CATEGORIES[:-1]} | {
        "irrelevance": pairs}


def _made_row(category: str, functions: list[dict], rng: random.Random,
              twins: bool) -> tuple[dict, Optional[dict]]:
    """A row of ``category`` and, with ``twins`` on an irrelevance row, its twin (else None)."""
    if not (twins and category == "irrelevance"):
        return make_row(category, functions, rng), None
    row, asked, request = _irrelevance_pair(rng.choice(functions), functions, rng)
    return row, twin_row(row, asked, request, rng)


def make_rows(n: int, functions: list[dict], seed: int, split: str,
              mix: Optional[dict] = None, twins: bool = False) -> list[dict]:
    """``n`` rows over ``functions`` in the categories of ``mix``; no two share a request (but an
    irrelevance row and its twin, with ``twins``: see the module's docstring); ids
    ``functions_<split>_<category>_<number>`` (a twin: ``..._multiple_twin_<its irrelevance row's
    number>``); shuffled (a ``--limit`` takes every category), a twin beside its pair."""
    rng = random.Random(seed)
    counts = category_counts(n, mix)
    units: list[list[dict]] = []
    seen: set[str] = set()
    for category, count in (twin_counts(counts, mix) if twins else counts).items():
        made = 0
        for _ in range(100 * count + 100):
            if made == count:
                break
            row, twin = _made_row(category, functions, rng, twins)
            text = row["messages"][0]["content"]
            if text in seen or (category.startswith("parallel") and len(row["ground_truth"]) < 2):
                continue
            seen.add(text)
            made += 1
            unit = [{"id": f"functions_{split}_{category}_{made:04d}", **row}]
            if twin is not None:
                unit.append({"id": f"functions_{split}_multiple_twin_{made:04d}", **twin})
                rng.shuffle(unit)
            units.append(unit)
        if made < count:
            raise UserError(f"cannot generate {count} distinct {category} rows; ask for fewer")
    rng.shuffle(units)
    return [row for unit in units for row in unit]


def sft_chat(row: dict, rng: random.Random) -> dict:
    """A training row as a chat: the request, then the assistant's calls (each argument at its first
    allowed value, left out where it may be) or, with no call expected, a short refusal."""
    if not row["ground_truth"]:
        answer = {"role": "assistant", "content": rng.choice(_DECLINES)}
    else:
        calls = [ToolCall(name, canonical_arguments(arguments)).as_dict()
                 for entry in row["ground_truth"] for name, arguments in entry.items()]
        answer = {"role": "assistant", "content": "", "tool_calls": calls}
    return {"messages": [*row["messages"], answer], "tools": row["tools"]}


def canonical_arguments(allowed: dict) -> dict:
    """One right call's arguments: each argument's first allowed value, nested objects too; an
    argument whose first allowed value is "" (left out) is left out."""
    arguments = {}
    for name, values in allowed.items():
        first = values[0]
        if first == "":
            continue
        if isinstance(first, dict):
            first = canonical_arguments(first)
        arguments[name] = first
    return arguments


def check_counts(n_train: int, n_heldout: int) -> None:
    """Refuse counts out of range (one line naming the range)."""
    if not 1 <= n_train <= MAX_TRAIN or not 0 <= n_heldout <= MAX_HELDOUT:
        raise UserError(f"--train must be 1 to {MAX_TRAIN} and --heldout 0 to {MAX_HELDOUT} for "
                        f"--kind functions (got {n_train} and {n_heldout})")


def function_tasks(train: int = 1000, heldout: int = 250, seed: int = 0,
                   mix: Optional[dict] = None, twins: bool = False) -> dict[str, list[dict]]:
    """The rows of each file (``sft``, ``train``, ``heldout``), without writing them; ``twins``:
    each training irrelevance row with its twin (the module's docstring)."""
    check_counts(train, heldout)
    train_functions, heldout_functions = split_functions(seed)
    train_rows = make_rows(train, train_functions, seed + 1, "train", mix, twins)
    heldout_rows = make_rows(heldout, heldout_functions, seed + 2, "heldout", mix)
    rng = random.Random(seed + 3)
    return {"sft": [sft_chat(row, rng) for row in train_rows], "train": train_rows,
            "heldout": heldout_rows}


def write_function_tasks(out, train: int = 1000, heldout: int = 250, seed: int = 0,
                         overwrite: bool = False, mix: Optional[dict] = None,
                         twins: bool = False) -> dict[str, Path]:
    """Write ``sft.jsonl``, ``train.jsonl`` and ``heldout.jsonl`` of the function-calling family
    into ``out``; returns their paths keyed ``sft``, ``train``, ``heldout``. ``twins``: each
    training irrelevance row gets a twin that calls (the module's docstring). Nothing is written
    when a count is out of range or a file exists (unless ``overwrite``)."""
    folder = Path(out)
    paths = {name: folder / f"{name}.jsonl" for name in FILES}
    check_counts(train, heldout)
    existing = [str(path) for path in paths.values() if path.exists()]
    if existing and not overwrite:
        raise UserError(f"{', '.join(existing)} already exist; "
                        "choose another --out or pass --overwrite")
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {folder} is a file; pass a directory")
    rows = function_tasks(train, heldout, seed, mix, twins)
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in paths.items():
        write_text_atomic(path, jsonl_text(rows[name]))
    return paths
