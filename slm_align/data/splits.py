"""Deterministic train / eval / held-out-prompt split that never leaks an item across parts.

Identical items (same :meth:`Example.key`) collapse to one before splitting, and each item's place
is decided by a seeded hash of its content, so a held-out item can never also be a training item.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from slm_align.data.examples import Example
from slm_align.errors import UserError

MIN_DOCUMENTS = 10


@dataclass(frozen=True)
class Splits:
    """The three disjoint parts of a corpus."""

    train: list[Example]
    eval: list[Example]
    heldout: list[Example]
    duplicates_dropped: int = 0


def seeded_rank(seed: int, key: str) -> str:
    """The sort key that splits without leaks: a seeded hash of an item's canonical text
    (same text, same side)."""
    return hashlib.sha256(f"{seed}\x00{key}".encode()).hexdigest()


def _rank(seed: int, example: Example) -> str:
    return seeded_rank(seed, example.key())


def split_examples(examples: list[Example], seed: int, eval_fraction: float,
                   heldout_prompts: int) -> Splits:
    """Split by seeded content hash: held-out prompts first (at most 10%),
    then eval, the rest train."""
    unique = list({ex.key(): ex for ex in examples}.values())
    if len(unique) < MIN_DOCUMENTS:
        raise UserError(f"the corpus has {len(unique)} distinct documents; need at least "
                        f"{MIN_DOCUMENTS} to split into train, eval and held-out prompts")
    ordered = sorted(unique, key=lambda ex: _rank(seed, ex))
    n_heldout = max(1, min(heldout_prompts, len(ordered) // 10))
    n_eval = max(1, round(len(ordered) * eval_fraction))
    return Splits(
        heldout=ordered[:n_heldout],
        eval=ordered[n_heldout:n_heldout + n_eval],
        train=ordered[n_heldout + n_eval:],
        duplicates_dropped=len(examples) - len(unique),
    )
