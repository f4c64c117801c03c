"""Token-weighted perplexity: exp(total NLL / total scored tokens), unchanged by
batch size or padding."""

from __future__ import annotations

import math
from dataclasses import dataclass

from slm_align.data.encoding import IGNORE_INDEX, pad_batch
from slm_align.modeling.accelerator import device_of
from slm_align.progress import counted


@dataclass(frozen=True)
class Perplexity:
    """Held-out perplexity and what it was computed from."""

    ppl: float
    nll_sum: float
    tokens: int
    documents: int


def labelled_logprobs(model, batch: dict):
    """Log-probability of every labelled token under ``model``, in float32, and the label mask.

    batch: ``input_ids``, ``attention_mask``, ``labels`` (B, T) from
    :func:`slm_align.data.encoding.pad_batch`, right padded, -100 where no label. Returns (B, T-1)
    log p(x_t | x_<t) at the labelled targets (0 elsewhere) and the (B, T-1) bool mask: position t
    of the outputs predicts token t+1 of the input.
    """
    import torch

    batch = {key: value.to(device_of(model)) for key, value in batch.items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * mask, mask


def perplexity(model, encoded: list[dict[str, list[int]]], pad_id: int, batch_size: int = 8,
               what: str = "perplexity") -> Perplexity:
    """Sum NLL over every scored token of every document in float32, then divide once.

    Averaging per batch (or per sequence) would weight short documents differently depending on how
    they were batched; summing first makes the figure independent of batching and padding. ``what``
    names the documents counted in the running stage's progress
    (:func:`slm_align.progress.counted`).
    """
    import torch

    nll_sum = 0.0
    tokens = 0
    model.eval()
    with torch.no_grad(), counted(what, len(encoded), "documents") as count:
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start:start + batch_size]
            picked, mask = labelled_logprobs(model, pad_batch(batch, pad_id))
            nll_sum += float(-picked.sum().double())
            tokens += int(mask.sum())
            count.advance(len(batch))
    if tokens == 0:
        raise ValueError("no tokens to score")
    return Perplexity(ppl=math.exp(nll_sum / tokens), nll_sum=nll_sum, tokens=tokens,
                      documents=len(encoded))
