"""Batched sampling from a causal LM with the KV cache: left-padded prompts, stop at EOS.

One function serves the headroom gate's reward spread, RL rollouts and evaluation, so that every stage
samples the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Samples:
    """Completions of a batch of prompts, as text and as right-padded token ids with a mask."""

    prompts: list[str]
    completions: list[str]
    prompt_ids: "object"  # (B, P) left-padded LongTensor
    prompt_mask: "object"  # (B, P)
    completion_ids: "object"  # (B, T) tokens after the prompt; padding after EOS
    completion_mask: "object"  # (B, T) 1 up to and including EOS
    truncated: list[bool]  # no EOS within max_new_tokens


def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, seed: Optional[int] = None) -> Samples:
    """Sample one completion per prompt (pure temperature sampling unless ``top_p`` < 1; greedy at 0)."""
    import torch

    encoded = [tokenizer(p, add_special_tokens=True)["input_ids"] or [tokenizer.eos_token_id] for p in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    if seed is not None:
        torch.manual_seed(seed)
    greedy = temperature == 0
    options = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p,
                                                        top_k=0)
    with torch.no_grad():
        output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, use_cache=True, **options)
    completion_ids = output[:, width:]
    is_eos = completion_ids == tokenizer.eos_token_id
    ended = is_eos.cumsum(-1)
    completion_mask = ((ended == 0) | (is_eos & (ended == 1))).long()  # through the first EOS
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(completion_ids, completion_mask)]
    truncated = (~is_eos.any(-1)).tolist()
    return Samples(list(prompts), texts, prompt_ids, prompt_mask, completion_ids, completion_mask, truncated)
