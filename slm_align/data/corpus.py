"""A corpus ready for every stage: read (or generated), deduplicated and split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slm_align.config import DataSettings
from slm_align.data.demo_corpus import generate_stories
from slm_align.data.examples import Example
from slm_align.data.readers import fingerprint, read_examples
from slm_align.data.splits import Splits, split_examples
from slm_align.errors import UserError

# Generator seed of the demo corpus that SFT uses. The bundled base was pretrained
# on another seed (1234).
DEMO_SEED = 0


@dataclass(frozen=True)
class Corpus:
    """The split corpus, how it was described to the user, and a fingerprint of its source bytes."""

    splits: Splits
    description: str
    fingerprint: str


def load_corpus(settings: DataSettings, seed: int) -> Corpus:
    """Read ``settings.path`` (or generate the demo stories: path ``demo`` or unset) and
    split it with ``seed``."""
    if settings.uses_demo:
        examples = [Example(text=t) for t in generate_stories(settings.demo_documents,
                                                              seed=DEMO_SEED)]
        description = f"demo stories ({settings.demo_documents} documents)"
    else:
        path = Path(settings.path)
        examples = read_examples(path, settings.text_field)
        description = str(path)
    splits = split_examples(examples, seed=seed, eval_fraction=settings.eval_fraction,
                            heldout_prompts=settings.heldout_prompts)
    return Corpus(splits=splits, description=description, fingerprint=source_fingerprint(settings))


def source_fingerprint(settings: DataSettings) -> str:
    """What identifies the corpus's source: the demo's size and seed, or a
    fingerprint of the data's bytes."""
    if settings.uses_demo:
        return f"demo:{settings.demo_documents}:{DEMO_SEED}"
    return fingerprint(Path(settings.path))


NO_DATA = ("no training data: pass --data FILE (txt, jsonl, parquet, csv, a datasets directory or "
           "a hub dataset id) or --data demo for the generated demo stories")


def require_data(settings: DataSettings, from_run: bool = False,
                 tasks_stand_in: bool = False) -> None:
    """Refuse to fall back on the demo stories unasked (the command line's check; library callers
    that want the demo leave ``path`` unset). Data is given when ``path`` is set (``demo``
    included), when the stage takes it from a finished SFT stage (``from_run``), or when a task file
    stands in for the corpus (``tasks_stand_in``)."""
    if settings.path is not None or from_run:
        return
    if tasks_stand_in and settings.tasks is not None:
        return
    raise UserError(NO_DATA)
