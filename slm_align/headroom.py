"""The headroom gate: is the SFT prior fluent enough (and, later, the reward discriminative enough) for RL?

The report is a list of figures, each with its threshold, verdict and remedy, so that later checks (reward
accuracy, reward spread) join the same table.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from slm_align.config import Recipe
from slm_align.data.corpus import load_corpus
from slm_align.data.encoding import encode_all
from slm_align.errors import UserError
from slm_align.modeling import load_adapter, load_model, load_tokenizer, resolve_source
from slm_align.perplexity import perplexity
from slm_align.runs import write_json_atomic
from slm_align.sft import recipe_from_sft

REMEDY_PPL = ("the SFT prior is not fluent enough for RL to help: train SFT longer or on more or cleaner data, "
              "raise the LoRA rank (--lora-r), or start from a larger base model")


@dataclass
class Figure:
    """One gated measurement: ``value`` must be below (``"<"``) or at least (``">="``) ``threshold``."""

    name: str
    value: float
    threshold: float
    comparison: str
    remedy: str

    @property
    def passed(self) -> bool:
        return self.value < self.threshold if self.comparison == "<" else self.value >= self.threshold


@dataclass
class HeadroomReport:
    """Every figure of the gate, context that is not gated (``info``), and the verdict."""

    figures: list[Figure]
    info: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.figures)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def failures(self) -> list[Figure]:
        return [f for f in self.figures if not f.passed]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "passed": self.passed, "info": self.info,
                "figures": [dict(asdict(f), passed=f.passed) for f in self.figures],
                "reasons": [f"{f.name} {f.value:.4g} is not {f.comparison} {f.threshold:g}" for f in self.failures()],
                "remedies": [f.remedy for f in self.failures()]}


def check_headroom(recipe: Recipe, run: Optional[Path] = None, adapter: Optional[Path] = None) -> HeadroomReport:
    """Measure the gate's figures for a run (or a model plus optional adapter) and write ``run/headroom.json``."""
    started = time.time()
    if run is not None and adapter is None:
        recipe, adapter = recipe_from_sft(run, recipe)
    source = resolve_source(recipe.model.source)
    tokenizer = load_tokenizer(source, recipe.model.trust_remote_code)
    corpus = load_corpus(recipe.data, recipe.seed)
    documents = corpus.splits.eval[: recipe.headroom.max_documents]
    encoded = encode_all(documents, tokenizer, recipe.data.max_length)
    if not encoded:
        raise UserError(f"data {corpus.description}: no eval document has tokens to score")
    model = load_model(source, recipe.model.trust_remote_code, recipe.model.allow_pickle)
    info = {"model": source.label, "data": corpus.description, "eval_documents": len(encoded)}
    if adapter is not None:
        model = load_adapter(model, adapter)
        with model.disable_adapter():
            info["base_ppl"] = perplexity(model, encoded, tokenizer.pad_token_id, recipe.headroom.batch_size).ppl
        info["adapter"] = str(adapter)
    measured = perplexity(model, encoded, tokenizer.pad_token_id, recipe.headroom.batch_size)
    info.update(eval_tokens=measured.tokens, seconds=round(time.time() - started, 2))
    report = HeadroomReport([Figure("held-out perplexity", measured.ppl, recipe.headroom.max_ppl, "<", REMEDY_PPL)],
                            info)
    if run is not None:
        write_json_atomic(Path(run) / "headroom.json", report.to_dict())
    return report
