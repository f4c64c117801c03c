"""Calibration text for quantization: the run's own held-out texts, never a
training or evaluation item.

The run's corpus is split by seeded content hash into train, eval and held-out prompts
(data/splits.py). Training items would flatter the quantized model on what it memorised, and
evaluation items are what ``evaluate`` and the headroom gate score it on; calibrating on either
would leak. So calibration reads the held-out part only, and drops any item whose canonical key also
appears among the train or eval items.
"""

from __future__ import annotations

from pathlib import Path

from slm_align.data.examples import Example
from slm_align.errors import UserError

MAX_TEXTS = 32
CALIBRATION_TOKENS = 512  # per text: the statistic is a mean over tokens, a few thousand are plenty


def plain_text(example: Example) -> str:
    """The words of an item, whatever its shape (text; prompt + completion; chat messages)."""
    if example.messages is not None:
        return "\n".join(content for _, content in example.messages)
    if example.prompt is not None:
        return f"{example.prompt}{example.completion or ''}"
    return example.text or ""


def calibration_texts(run: Path, limit: int = MAX_TEXTS) -> list[str]:
    """Up to ``limit`` held-out texts of ``run``'s corpus, none of them a
    training or evaluation item."""
    from slm_align.config import load_recipe
    from slm_align.config.from_sft import recipe_from_sft
    from slm_align.data.corpus import load_corpus

    recipe, _ = recipe_from_sft(Path(run), load_recipe(None, {}))
    splits = load_corpus(recipe.data, recipe.seed).splits
    seen = {example.key() for example in splits.train + splits.eval}
    texts = [plain_text(example) for example in splits.heldout if example.key() not in seen]
    texts = [text for text in texts if text.strip()][:limit]
    if not texts:
        raise UserError(f"run {run} has no held-out texts to calibrate on; "
                        "export without --calibrate")
    return texts


def run_importance(run: Path, checkpoint: Path) -> tuple[dict, int]:
    """llama.cpp's importance matrix of ``checkpoint`` over ``run``'s calibration texts (by GGUF
    tensor name), and how many texts it saw."""
    from slm_align.export.converters.imatrix import activation_importance, gguf_importance
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(checkpoint))
    tokenizer = load_tokenizer(source)
    texts = calibration_texts(run)
    ids = [tokenizer(text)["input_ids"][:CALIBRATION_TOKENS] for text in texts]
    return gguf_importance(checkpoint, activation_importance(load_model(source), ids)), len(texts)
