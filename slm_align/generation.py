"""Batched sampling from a causal LM with the KV cache: left-padded prompts, stop at EOS.

One function serves the headroom gate's reward spread, RL rollouts and evaluation, so that every stage
samples the same way. The caller's settings alone decide how: a checkpoint's ``generation_config.json``
(``repetition_penalty``, ``no_repeat_ngram_size``, ``top_k``, bad words, ...) is ignored, so RL
samples from exactly the distribution whose log-probabilities it recomputes and scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from slm_align.errors import UserError


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
    logprobs: "object" = None  # (B, T) the sampler's own log-probabilities of its tokens, when asked for


def recipe_config(max_new_tokens: int, temperature: float, top_p: float, eos_token_id: int, pad_token_id: int):
    """A fresh ``GenerationConfig`` holding only our settings: pure temperature sampling (nucleus when ``top_p`` <
    1), greedy at temperature 0; no repetition penalty, n-gram ban, top-k or bad words."""
    from transformers import GenerationConfig

    if temperature == 0:
        options = dict(do_sample=False)
    else:
        options = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            use_cache=True, **options)


def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, seed: Optional[int] = None, with_logprobs: bool = False) -> Samples:
    """Sample one completion per prompt (pure temperature sampling unless ``top_p`` < 1; greedy at 0).

    ``with_logprobs`` also returns the sampler's own log-probabilities of the tokens it drew (from the processed
    scores ``generate`` sampled from), at the cost of keeping every step's full-vocabulary scores.
    """
    import torch

    from slm_align.accelerator import device_of

    encoded = [tokenizer(p, add_special_tokens=True)["input_ids"] or [tokenizer.eos_token_id] for p in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    device = device_of(model)
    prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
    if seed is not None:
        torch.manual_seed(seed)
    config = recipe_config(max_new_tokens, temperature, top_p, tokenizer.eos_token_id, pad)
    with torch.no_grad():  # use_model_defaults=False: no setting left at its default is filled from the checkpoint
        output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                use_model_defaults=False, output_scores=with_logprobs, return_dict_in_generate=True)
    completion_ids = output.sequences[:, width:]
    is_eos = completion_ids == tokenizer.eos_token_id
    ended = is_eos.cumsum(-1)
    completion_mask = ((ended == 0) | (is_eos & (ended == 1))).long()  # through the first EOS
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(completion_ids, completion_mask)]
    truncated = (~is_eos.any(-1)).tolist()
    logprobs = _sampler_logprobs(output.scores, completion_ids, completion_mask) if with_logprobs else None
    return Samples(list(prompts), texts, prompt_ids, prompt_mask, completion_ids, completion_mask, truncated,
                   logprobs)


def score(reward_fn, samples: Samples) -> list[float]:
    """``reward_fn``'s score of each completion as written: the reward learns which ones were cut at the token
    budget (``truncated``), so that no EOS is put on them; a NaN or inf stops with the term and the prompt."""
    scores = [float(s) for s in reward_fn(samples.prompts, samples.completions, truncated=samples.truncated)]
    bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        i = bad[0]
        raise UserError(f"reward {_failing_term(reward_fn, samples, i)} gave {scores[i]} for prompt "
                        f"{samples.prompts[i][:60]!r} (completion {samples.completions[i][:40]!r}; {len(bad)} of "
                        f"{len(scores)} non-finite); make the reward return finite numbers for every completion")
    return scores


def _failing_term(reward_fn, samples: Samples, i: int) -> str:
    """The name of the first term of a combined reward whose score ``i`` is not finite (else the function's)."""
    if hasattr(reward_fn, "breakdown"):
        parts = reward_fn.breakdown(samples.prompts, samples.completions, truncated=samples.truncated)
        for name, values in parts.items():
            if not math.isfinite(values[i]):
                return f"term {name!r}"
    return repr(getattr(reward_fn, "__name__", type(reward_fn).__name__))


def _sampler_logprobs(scores, completion_ids, completion_mask):
    """log softmax of the processed scores at each drawn token: (B, T), 0 after the first EOS.

    ``scores`` is ``generate``'s tuple of T tensors (B, V): the logits after every processor and warper, i.e.
    the distribution each token was drawn from (-inf where top-p removed a token).
    """
    import torch

    logp = torch.log_softmax(torch.stack(scores, dim=1).float(), dim=-1)
    drawn = logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return drawn.masked_fill(completion_mask == 0, 0.0)
