"""Batched sampling from a causal LM with the KV cache: left-padded prompts, stop at EOS.

One function serves the headroom gate's reward spread, RL rollouts and evaluation, so that every
stage samples the same way. The caller's settings alone decide how: a checkpoint's
``generation_config.json`` (``repetition_penalty``, ``no_repeat_ngram_size``, ``top_k``, bad
words, ...) is never read, so RL samples from exactly the distribution whose log-probabilities
it recomputes and scores.

The decoding loop is ours, on the model's own ``prepare_inputs_for_generation`` and cache:
``generate`` draws each token with ``torch.multinomial``, an exponential draw over every vocabulary
entry; :func:`draw_tokens` inverts the cumulative distribution instead, one uniform number per row.
Over Gemma 3's 262k vocabulary (8 rows, 1 thread) the softmax and multinomial took 54 ms of CPU per
token, :func:`draw_tokens` 21 ms; the model's forward is the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from slm_align.data.encoding import opening_ids
from slm_align.errors import UserError
from slm_align.progress import Count, counted


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


def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, seed: Optional[int] = None, with_logprobs: bool = False) -> Samples:
    """Sample one completion per prompt (pure temperature sampling unless
    ``top_p`` < 1; greedy at 0).

    ``with_logprobs`` also returns the sampler's own log-probabilities of the tokens it drew (the
    log-softmax of the temperature-scaled, nucleus-filtered logits each token was drawn from; of
    the raw logits when greedy).
    """
    import torch

    from slm_align.modeling.accelerator import device_of

    encoded = [opening_ids(tokenizer, p) or [tokenizer.eos_token_id] for p in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    device = device_of(model)
    prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded],
                               device=device)
    if seed is not None:
        torch.manual_seed(seed)
    with counted("sampling", max_new_tokens, f"tokens of {len(prompts)} completions") as count:
        with torch.no_grad():
            rule = DecodeRule(max_new_tokens, temperature, top_p, tokenizer.eos_token_id, pad)
            completion_ids, drawn_logprobs = _decode(model, prompt_ids, prompt_mask, rule, count)
    is_eos = completion_ids == tokenizer.eos_token_id
    ended = is_eos.cumsum(-1)
    completion_mask = ((ended == 0) | (is_eos & (ended == 1))).long()  # through the first EOS
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(completion_ids, completion_mask)]
    truncated = (~is_eos.any(-1)).tolist()
    logprobs = None
    if with_logprobs:
        logprobs = drawn_logprobs.masked_fill(completion_mask == 0, 0.0)
    return Samples(list(prompts), texts, prompt_ids, prompt_mask, completion_ids, completion_mask,
                   truncated, logprobs)


@dataclass(frozen=True)
class DecodeRule:
    """How :func:`_decode` draws and when it stops."""

    max_new_tokens: int
    """The most tokens a row gets."""
    temperature: float
    """Softmax temperature (0: greedy)."""
    top_p: float
    """Nucleus mass kept (1: all of it)."""
    eos: int
    """The id that ends a row."""
    pad: int
    """The id put after a row's EOS."""


def _decode(model, prompt_ids, prompt_mask, rule: DecodeRule, count: Optional[Count] = None):
    """Decode up to ``rule.max_new_tokens`` tokens for a left-padded batch with the KV cache, as
    ``generate`` does (the model's own ``prepare_inputs_for_generation``; positions that skip the
    padding), until every row has an EOS. ``count`` advances by one per token position (a stage's
    progress; inactive in RL rollouts).

    Returns (B, T) token ids (``rule.pad`` after a row's EOS) and (B, T) fp32
    log-probabilities of the drawn tokens.
    """
    import torch

    # LoRA layers stay in place
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    batch = prompt_ids.shape[0]
    ids = prompt_ids
    mask = prompt_mask
    cache_position = torch.arange(prompt_ids.shape[1], device=prompt_ids.device)
    cache = None
    done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    tokens = []
    logprobs = []
    keep_last = _keeps_last_logits(lm)
    for _ in range(rule.max_new_tokens):
        inputs = lm.prepare_inputs_for_generation(ids, past_key_values=cache, attention_mask=mask,
                                                  cache_position=cache_position, use_cache=True)
        inputs.update(keep_last)
        output = lm(**inputs)
        cache = output.past_key_values
        token, logprob = draw_tokens(output.logits[:, -1].float(), rule.temperature, rule.top_p)
        token = token.masked_fill(done, rule.pad)
        tokens.append(token)
        logprobs.append(logprob)
        if count is not None:
            count.advance()
        done = done | (token == rule.eos)
        if bool(done.all()):
            break
        ids = torch.cat([ids, token.unsqueeze(-1)], dim=-1)
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
        cache_position = cache_position[-1:] + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _keeps_last_logits(lm) -> dict:
    """``logits_to_keep=1`` when the model's forward takes it (no vocabulary projection over the
    prompt), as ``generate`` passes it; nothing otherwise."""
    import inspect

    if "logits_to_keep" in inspect.signature(lm.forward).parameters:
        return {"logits_to_keep": 1}
    return {}


def draw_tokens(logits, temperature: float, top_p: float = 1.0, generator=None):
    """One token per row of ``logits`` (B, V) fp32, and its log-probability under the
    distribution it was drawn from.

    Greedy at ``temperature`` 0 (argmax; log-softmax of the raw logits). Otherwise p =
    softmax(nucleus_top_p(z / T)) (transformers' ``TopPLogitsWarper`` when ``top_p`` < 1), drawn by
    inverting its cumulative distribution: with w_v = exp(z_v / T - max) (fp32) and their running
    sums c_v (float64), u ~ U[0, 1) per row, the token is the first v with c_v > u c_V, so that P(v)
    = w_v / c_V = p_v, and a token of weight 0 is never drawn. Its log-probability is z_v / T - max
    - log c_V. Returns (B,) token ids and (B,) fp32 log p_token. ``generator``: the uniform
    numbers' torch generator (the global one by default).
    """
    import torch

    if temperature == 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    scaled = logits / temperature
    if top_p < 1.0:
        from transformers import TopPLogitsWarper

        scaled = TopPLogitsWarper(top_p)(None, scaled)
    peak = scaled.max(-1, keepdim=True).values
    weights = scaled.sub(peak).exp_()
    cumulative = torch.cumsum(weights, -1, dtype=torch.float64)
    total = cumulative[:, -1:]
    if not bool(torch.isfinite(total).all()):  # torch.multinomial refuses these too
        raise RuntimeError("non-finite logits while sampling: the model's weights or "
                           "inputs hold NaN or inf")
    target = torch.rand(logits.shape[0], 1, dtype=torch.float64, device=logits.device, generator=generator) * total
    token = torch.searchsorted(cumulative, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    impossible = weights.gather(-1, token.unsqueeze(-1)).squeeze(-1) == 0  # u rounded up to the total
    if bool(impossible.any()):
        token = torch.where(impossible, scaled.argmax(-1), token)
    drawn = scaled.gather(-1, token.unsqueeze(-1)) - peak - total.log().float()
    return token, drawn.squeeze(-1)


def score(reward_fn, samples: Samples) -> list[float]:
    """``reward_fn``'s score of each completion as written: the reward learns which ones were cut
    at the token budget (``truncated``), so that no EOS is put on them; a NaN or inf stops with
    the term and the prompt."""
    scores = [float(s) for s in reward_fn(samples.prompts, samples.completions, truncated=samples.truncated)]
    bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        i = bad[0]
        raise UserError(f"reward {_failing_term(reward_fn, samples, i)} gave {scores[i]} for "
                        f"prompt {samples.prompts[i][:60]!r} (completion "
                        f"{samples.completions[i][:40]!r}; {len(bad)} of {len(scores)} "
                        f"non-finite); make the reward return finite numbers for every completion")
    return scores


def _failing_term(reward_fn, samples: Samples, i: int) -> str:
    """The name of the first term of a combined reward whose score ``i`` is not finite
    (else the function's)."""
    if hasattr(reward_fn, "breakdown"):
        parts = reward_fn.breakdown(samples.prompts, samples.completions, truncated=samples.truncated)
        for name, values in parts.items():
            if not math.isfinite(values[i]):
                return f"term {name!r}"
    return repr(getattr(reward_fn, "__name__", type(reward_fn).__name__))
