"""Choosing the call rule's threshold (:mod:`~slm_align.ondevice.agent.call_rule`) for one model on
function rows whose right answer is known: rows that call, and rows no offered function fits
(irrelevance), for example the training split of ``tasks make --kind functions``.

Under greedy decoding the rule's decision on a prompt depends on one number, the prompt's *opening
score*. Follow the reply while it stays blank, taking at each position the likeliest token that does
not open a call; the score is the largest probability of opening a call met on the way:

    s = max over i < n of p_i,        p_i = sum over openers of softmax(logits_i)    logits_i: (vocab,)

where position i + 1 follows the likeliest non-opener at i when that token is blank, and n is the
first position whose likeliest non-opener is not blank (text, or the end of the turn), at most
:data:`MAX_BLANKS`. At threshold t the rule bans the openers at every p_i < t, so greedy decoding
walks that same path and opens a call at the first p_i >= t: it calls exactly when s >= t. One pass
per prompt therefore gives the decision at every threshold.

A call row is decided right when s >= t, an irrelevance row when s < t (whether the call's arguments
are right is another matter: the rule only decides whether to call). The threshold chosen maximises
the balanced accuracy of that decision,

    B(t) = ( #{call rows: s >= t} / #call rows  +  #{irrelevance rows: s < t} / #irrelevance rows ) / 2,

over the grid 0, 0.01, ..., 1, taking the middle of the widest stretch of the grid where B is best
(a threshold inside a plateau rather than on its edge, where the next prompt's score may fall).
Balanced, so that neither kind of row outweighs the other by its count: a model that calls
everywhere scores 0.5, as does one that never calls.

No library computes this: it needs the rule's own walk over blank tokens. Stdlib and numpy only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent import function_eval
from slm_align.ondevice.agent.call_rule import CallVocabulary, call_vocabulary, opener_mask, opening_probability
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.task_eval import load_tasks, open_agent
from slm_align.progress import counted, stage_lines

MAX_BLANKS = 8
"""Most positions the walk decides (the first and up to 7 blank tokens after it; no template's reply opens
with more blanks)."""

GRID = np.round(np.linspace(0.0, 1.0, 101), 2)
"""The thresholds considered: 0, 0.01, ..., 1."""


@dataclass(frozen=True)
class OpeningScore:
    """One row's opening score and what its right answer is."""

    score: float
    """The largest P(open a call) on the greedy blank walk (see the module's docstring)."""
    calls: bool
    """The row's right answer calls (its ground truth names calls); False: an irrelevance row."""
    category: str
    """The row's category (``simple``, ``irrelevance``, ...; empty when it has none)."""


def opening_score(backend, prompt: Sequence[int], vocabulary: CallVocabulary, stops: set) -> float:
    """``prompt``'s opening score on ``backend`` (fed from a reset cache): the largest P(open) while the
    likeliest non-opener is blank. ``stops``: the ids that end the reply (they end the walk too)."""
    backend.reset()
    logits = backend.feed(list(prompt))
    openers = opener_mask(vocabulary, len(logits))
    best = 0.0
    for position in range(MAX_BLANKS):
        logits = np.array(logits, dtype=np.float32)
        best = max(best, opening_probability(logits, openers))
        logits[openers] = -np.inf
        token = int(np.argmax(logits))
        walks_on = token not in stops and token < len(vocabulary.blank) and vocabulary.blank[token]
        if not walks_on or position == MAX_BLANKS - 1:
            break
        logits = backend.feed([token])
    return best


def row_scores(agent: Agent, rows: Sequence[dict], label: str = "call threshold") -> list[OpeningScore]:
    """Each function row's :class:`OpeningScore` in ``agent``: its messages and tools rendered as
    :func:`~slm_align.ondevice.agent.task_eval.run_function_task` renders them (the agent's tools are put
    back after). Counted as ``label`` in the running stage's progress."""
    backend = getattr(agent.backend, "inner", agent.backend)
    vocabulary = call_vocabulary(backend)
    stops = agent.chat_stops()
    scores = []
    tools = agent.tools
    try:
        with counted(label, len(rows), "rows") as count:
            for row in rows:
                agent.tools = function_eval.function_registry(row)
                prompt, _ = agent.prompt_tokens(function_eval.function_messages(row), agent.sampling.max_tokens)
                score = opening_score(backend, prompt, vocabulary, stops)
                calls = bool(row["ground_truth"])
                scores.append(OpeningScore(score=score, calls=calls, category=str(row.get("category") or "")))
                count.advance()
    finally:
        agent.tools = tools
    return scores


def decision_rates(scores: Sequence[OpeningScore], threshold: float) -> dict:
    """At ``threshold``: the share of call rows that call (``call_rate``), of irrelevance rows that do not
    (``decline_rate``), and their mean (``balanced``)."""
    calling = np.array([s.calls for s in scores])
    opens = np.array([s.score >= threshold for s in scores])
    call_rate = float(opens[calling].mean())
    decline_rate = float((~opens[~calling]).mean())
    return {"threshold": float(threshold), "call_rate": call_rate, "decline_rate": decline_rate,
            "balanced": (call_rate + decline_rate) / 2}


def best_plateau_middle(values: np.ndarray) -> int:
    """The index in the middle of the longest run of ``values`` (1-D) equal to their maximum (the first
    such run where two are as long)."""
    best = values.max()
    longest_start, longest = 0, 0
    start = None
    for index, value in enumerate([*values.tolist(), None]):
        if value is not None and value == best:
            start = index if start is None else start
            continue
        if start is not None and index - start > longest:
            longest_start, longest = start, index - start
        start = None
    return longest_start + (longest - 1) // 2


def check_both_kinds(calls: Sequence[bool]) -> None:
    """Refuse (one line) rows whose right answers (``calls``: each row's answer calls) are all of one kind:
    no threshold separates them."""
    calling = sum(calls)
    if calling in (0, len(calls)):
        raise UserError("choosing a call threshold needs rows that call and rows that do not (irrelevance): "
                        f"got {calling} of {len(calls)} rows that call")


def choose_threshold(scores: Sequence[OpeningScore]) -> dict:
    """The threshold of the grid with the best balanced decision accuracy (the middle of its widest
    stretch), with the rates there, the number of rows and of call rows, and the whole table."""
    check_both_kinds([s.calls for s in scores])
    table = [decision_rates(scores, threshold) for threshold in GRID]
    chosen = table[best_plateau_middle(np.array([round(row["balanced"], 12) for row in table]))]
    return {**chosen, "rows": len(scores), "call_rows": sum(s.calls for s in scores), "table": table}


def choose_call_threshold(tasks: Union[str, Path], artifact: Union[str, Path], limit: Optional[int] = None,
                          threads: Optional[int] = None, chat_template: Optional[str] = None) -> dict:
    """The threshold for ``artifact`` chosen on the function rows of ``tasks`` (the first ``limit``), as
    ``slm-align choose-call-threshold`` reports it: :func:`choose_threshold`'s figures, the artifact, the
    rows' file, and each category's rate of calling at the chosen threshold. Rows that are not function
    rows, or of one kind only, are refused before any model runs (UserError)."""
    rows = load_tasks(tasks, limit)
    plain = [index for index, row in enumerate(rows) if not function_eval.is_function_row(row)]
    if plain:
        raise UserError(f"{tasks}: row {plain[0] + 1} is not a function row (no ground_truth); the call "
                        f"threshold is chosen on rows that call and irrelevance rows of tasks make --kind functions")
    check_both_kinds([bool(row["ground_truth"]) for row in rows])
    agent = open_agent(artifact, threads=threads, chat_template=chat_template)
    with stage_lines("choose-call-threshold", f"P(open a call) on {len(rows)} rows") as stage:
        scores = row_scores(agent, rows, label=Path(artifact).name)
        chosen = choose_threshold(scores)
        stage.figures = f"--call-threshold {chosen['threshold']:.2f}, balanced accuracy {chosen['balanced']:.3f}"
    by_category = {}
    for category in sorted({score.category for score in scores}):
        group = [score for score in scores if score.category == category]
        by_category[category] = {"rows": len(group),
                                 "call_rate": sum(s.score >= chosen["threshold"] for s in group) / len(group)}
    return {"artifact": str(artifact), "tasks": str(tasks), **chosen, "by_category": by_category,
            "scores": [asdict(score) for score in scores]}
