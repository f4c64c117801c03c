"""Preference rows for DPO and KTO: read, split by prompt, checked against the model
the feedback was given to.

The split is by prompt (a seeded hash of its text, as the corpus split): every answer to one prompt
lands on the same side, so held-out accuracy is measured on prompts the policy never trained on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from slm_align.data.pairs import Pair
from slm_align.data.preferences import Labelled, read_preference_rows
from slm_align.data.splits import seeded_rank
from slm_align.errors import UserError


@dataclass
class PreferenceData:
    """The training side as pairs and as labelled completions (each algorithm's ``prepare`` takes
    the kind it trains on), held-out pairs and labelled completions."""

    train_pairs: list[Pair]
    """Training pairs (thumbs of one prompt paired good-with-bad)."""
    train_labelled: list[Labelled]
    """Training labelled completions (each pair as a good and a bad one)."""
    heldout_pairs: list[Pair]
    heldout_labelled: list[Labelled]
    model_ids: set[str]
    prompts: int

    def label_share(self) -> float:
        """The rarer label's share of the training labelled completions (0.5 when there are
        none)."""
        labels = [item.label for item in self.train_labelled]
        if not labels:
            return 0.5
        good = sum(labels) / len(labels)
        return min(good, 1 - good)


def heldout_prompts(prompts: set[str], seed: int, fraction: float) -> set[str]:
    """The ``ceil(fraction * n)`` prompts of smallest seeded rank (at least one,
    never all when n > 1)."""
    ordered = sorted(prompts, key=lambda prompt: seeded_rank(seed, prompt))
    count = math.ceil(fraction * len(ordered))
    count = max(1, min(count, len(ordered) - 1))
    return set(ordered[:count])


def load_preference_data(paths: list[Path], tokenizer, algo: str, seed: int,
                         fraction: float) -> PreferenceData:
    """Read ``paths`` (pairs and thumbs in TRL's columns) and split them by prompt; the training
    side both as pairs (thumbs of one prompt paired good-with-bad) and as labelled completions
    (each pair as a good and a bad one). ``algo`` names the algorithm in the error message."""
    if not paths:
        raise UserError(f"--algo {algo} trains on preference files: pass --preferences FILE "
                        "(e.g. both files of `slm-align feedback export`, or TRL "
                        "prompt/chosen/rejected or prompt/completion/label rows)")
    rows = read_preference_rows(paths, tokenizer)
    prompts = {p.prompt for p in rows.pairs} | {item.prompt for item in rows.labelled}
    heldout = heldout_prompts(prompts, seed, fraction) if len(prompts) > 1 else set()
    pairs = rows.paired()
    labelled = rows.unpaired()
    return PreferenceData(train_pairs=[p for p in pairs if p.prompt not in heldout],
                          train_labelled=[item for item in labelled if item.prompt not in heldout],
                          heldout_pairs=[p for p in pairs if p.prompt in heldout],
                          heldout_labelled=[item for item in labelled if item.prompt in heldout],
                          model_ids=rows.model_ids, prompts=len(prompts))


def exported_digests(run: Path) -> dict[str, str]:
    """``{sha256: artifact path}`` of every artifact exported into ``run/export`` (the
    ids the runtime records)."""
    found = {}
    manifests = list(Path(run).glob("export/*.json")) + list(Path(run).glob("export/*/manifest.json"))
    for manifest in manifests:
        try:
            metrics = json.loads(manifest.read_text(encoding="utf-8")).get("metrics", {})
        except (OSError, ValueError):
            continue
        if isinstance(metrics, dict) and isinstance(metrics.get("sha256"), str):
            found[metrics["sha256"]] = str(manifest)
    return found


def check_feedback_models(model_ids: set[str], run: Path, any_model: bool) -> dict:
    """Whether the feedback was given to a model this run exported; rows without a
    model_id (TRL files) pass.

    Returns the manifest's record; feedback given to other models is a
    UserError unless ``any_model``."""
    known = exported_digests(run)
    foreign = sorted(model_ids - known.keys())
    record = {"model_ids": sorted(model_ids), "matched": sorted(model_ids & known.keys()), "foreign": foreign,
              "any_model": any_model}
    if foreign and not any_model:
        raise UserError(f"the preferences hold feedback given to {len(foreign)} model(s) this run did not export "
                        f"(first: sha256 {foreign[0][:12]}...; {run}/export has {len(known)} artifact(s)); train on "
                        "feedback about this run's model, or pass --any-model to use it anyway (recorded)")
    return record
