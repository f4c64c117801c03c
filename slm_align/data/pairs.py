"""Synthetic preference pairs from a plain corpus, in TRL's columns (``prompt``,
``chosen``, ``rejected``).

The prompt is a document's opening, chosen its true continuation, and rejected a corrupted
continuation: truncated, sentence-shuffled, another document's continuation (mismatch), or with
words dropped. Callers pass only training items: eval and held-out items never become pairs.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass, field

from slm_align.config import PairSettings
from slm_align.data.examples import Example
from slm_align.data.prompts import sentences, split_opening
from slm_align.errors import UserError

CORRUPTIONS = ("truncate", "shuffle", "mismatch", "dropout")


@dataclass(frozen=True)
class Pair:
    """One preference: ``chosen`` is preferred over ``rejected`` as a completion of ``prompt``."""

    prompt: str
    chosen: str
    rejected: str
    kind: str = "imported"

    def to_row(self) -> dict:
        return asdict(self)


@dataclass
class PairStats:
    """How many pairs each corruption made, and how many candidates were dropped and why."""

    made: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {"made": dict(self.made), "dropped": dict(self.dropped)}


def truncate(continuation: str, rng: random.Random) -> str:
    """Cut the continuation after 30-60% of its words, mid-sentence."""
    words = continuation.split()
    keep = max(1, int(len(words) * rng.uniform(0.3, 0.6)))
    return " " + " ".join(words[:keep]).rstrip(".!?")


def shuffle(continuation: str, rng: random.Random) -> str:
    """The same sentences in another order (unchanged when there is only one sentence)."""
    parts = sentences(continuation)
    for _ in range(10):
        order = parts[:]
        rng.shuffle(order)
        if order != parts:
            return " " + " ".join(order)
    return continuation


def drop_words(continuation: str, rng: random.Random, rate: float) -> str:
    """Remove each word with probability ``rate`` (at least one word goes)."""
    words = continuation.split()
    kept = [w for w in words if rng.random() >= rate]
    if len(kept) == len(words) and words:
        kept.pop(rng.randrange(len(kept)))
    return " " + " ".join(kept)


def _sources(examples: list[Example], opening_sentences: int, stats: PairStats) -> list[tuple[str, str]]:
    """(prompt, true continuation) of every item that has both."""
    found = []
    for example in examples:
        if example.prompt is not None:
            found.append((example.prompt, example.completion or ""))
        elif example.text is not None and (split := split_opening(example.text, opening_sentences)):
            found.append(split)
        else:
            stats.dropped["no prompt and continuation"] += 1
    return found


def synthetic_pairs(examples: list[Example], settings: PairSettings, seed: int) -> tuple[list[Pair], PairStats]:
    """One pair per usable item, the corruption drawn by ``settings.mix`` weights."""
    unknown = set(settings.mix) - set(CORRUPTIONS)
    if unknown or not any(w > 0 for w in settings.mix.values()):
        raise UserError(f"pair mix {settings.mix} is invalid; use positive weights for "
                        f"{', '.join(CORRUPTIONS)}")
    rng = random.Random(seed)
    stats = PairStats()
    sources = _sources(examples, settings.opening_sentences, stats)
    kinds, weights = zip(*[(k, w) for k, w in settings.mix.items() if w > 0])
    pairs = []
    for index, (prompt, chosen) in enumerate(sources):
        kind = rng.choices(kinds, weights)[0]
        if kind == "truncate":
            rejected = truncate(chosen, rng)
        elif kind == "shuffle":
            rejected = shuffle(chosen, rng)
        elif kind == "dropout":
            rejected = drop_words(chosen, rng, settings.dropout_rate)
        elif len(sources) > 1:  # mismatch: another item's continuation
            other = rng.randrange(len(sources) - 1)
            rejected = sources[other + (other >= index)][1]
        else:
            rejected = chosen
        if rejected.strip() == chosen.strip():
            stats.dropped["chosen equals rejected"] += 1
        elif min(len(chosen.split()), len(rejected.split())) < settings.min_words:
            stats.dropped["too short"] += 1
        else:
            pairs.append(Pair(prompt, chosen, rejected, kind))
            stats.made[kind] += 1
    return pairs, stats
