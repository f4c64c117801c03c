"""Rollouts: sample with the KV cache, then recompute log-probabilities under policy and reference in fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from slm_align.config import RLSettings
from slm_align.generation import sample, score
from slm_align.rl.policy import ValueHead, forward_logprobs, merged_for_sampling


@dataclass
class Rollout:
    """A batch of sampled completions with everything the update needs."""

    prompts: list[str]
    completions: list[str]
    input_ids: torch.Tensor  # (B, P+T): left-padded prompt, then completion
    attention_mask: torch.Tensor  # (B, P+T)
    prompt_width: int
    mask: torch.Tensor  # (B, T) float: completion tokens that train
    old_logprobs: torch.Tensor  # (B, T)
    ref_logprobs: torch.Tensor  # (B, T)
    values: Optional[torch.Tensor]  # (B, T), PPO only
    scores: torch.Tensor  # (B,) reward of each completion (after any length penalty)
    truncated: torch.Tensor  # (B,) bool

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_width:].sum(-1)


def collect(policy, value_head: Optional[ValueHead], tokenizer, reward_fn, prompts: list[str],
            settings: RLSettings, seed: int) -> Rollout:
    policy.eval()
    with merged_for_sampling(policy):
        samples = sample(policy, tokenizer, prompts, settings.max_new_tokens, settings.temperature, seed=seed)
    input_ids = torch.cat([samples.prompt_ids, samples.completion_ids], dim=1)
    attention = torch.cat([samples.prompt_mask, samples.completion_mask], dim=1)
    width = samples.prompt_ids.shape[1]
    with torch.no_grad():
        old, values = _scored(policy, input_ids, attention, width, settings, value_head)
        with policy.disable_adapter():
            ref, _ = _scored(policy, input_ids, attention, width, settings)
    truncated = torch.tensor(samples.truncated)
    scores = _penalised(torch.tensor(score(reward_fn, samples), dtype=torch.float32), samples, truncated, settings)
    mask = samples.completion_mask.float()
    if settings.mask_truncated:
        mask = mask * (~truncated).float().unsqueeze(-1)
    return Rollout(prompts, samples.completions, input_ids, attention, width, mask, old, ref, values, scores,
                   truncated)


def _penalised(scores: torch.Tensor, samples, truncated: torch.Tensor, settings: RLSettings) -> torch.Tensor:
    """Scores (B,) less the length penalty (per token past 80% of the budget) and the missing-EOS penalty."""
    lengths = samples.completion_mask.sum(-1).float()
    if settings.length_penalty:
        scores = scores - settings.length_penalty * (lengths - 0.8 * settings.max_new_tokens).clamp(min=0)
    return scores - settings.missing_eos_penalty * truncated.float()


def _scored(policy, input_ids, attention, width: int, settings: RLSettings, value_head=None):
    """Log-probs (and values) of the samples, a minibatch at a time: the full-vocabulary tensors of one minibatch
    are alive at once, not those of the whole rollout (with a 49k vocabulary that was 1.1 GB more than TRL)."""
    size = settings.minibatch_size
    parts = [forward_logprobs(policy, input_ids[i:i + size], attention[i:i + size], width, settings.temperature,
                              value_head, with_entropy=False) for i in range(0, input_ids.shape[0], size)]
    values = torch.cat([part[2] for part in parts]) if value_head is not None else None
    return torch.cat([part[0] for part in parts]), values


def _pad_to(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    pad = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def _row(r: Rollout, i: int, width: int, length: int, pad_id: int) -> dict:
    """Row ``i`` of a rollout re-padded to a prompt ``width`` (left) and completion ``length`` (right)."""
    prompt, completion = slice(None, r.prompt_width), slice(r.prompt_width, None)
    ids, att = r.input_ids[i:i + 1], r.attention_mask[i:i + 1]
    per_token = lambda t: None if t is None else _pad_to(t[i:i + 1], length, 0.0, False)  # noqa: E731
    return {
        "input_ids": torch.cat([_pad_to(ids[:, prompt], width, pad_id, True),
                                _pad_to(ids[:, completion], length, pad_id, False)], 1),
        "attention_mask": torch.cat([_pad_to(att[:, prompt], width, 0, True),
                                     _pad_to(att[:, completion], length, 0, False)], 1),
        "mask": per_token(r.mask), "old_logprobs": per_token(r.old_logprobs),
        "ref_logprobs": per_token(r.ref_logprobs), "values": per_token(r.values),
        "scores": r.scores[i:i + 1], "truncated": r.truncated[i:i + 1],
        "prompt": r.prompts[i], "completion": r.completions[i],
    }


def concat(first: Rollout, keep: list[int], second: Rollout, pad_id: int) -> Rollout:
    """``first`` with the rows not in ``keep`` replaced, in order, by the rows of ``second``.

    Prompts are re-padded on the left and completions on the right, so GRPO groups stay contiguous.
    """
    width = max(first.prompt_width, second.prompt_width)
    length = max(first.mask.shape[1], second.mask.shape[1])
    replacements = iter(range(len(second.prompts)))
    rows = [_row(first, i, width, length, pad_id) if i in keep else _row(second, next(replacements), width, length,
                                                                          pad_id)
            for i in range(len(first.prompts))]
    stack = lambda key: None if rows[0][key] is None else torch.cat([r[key] for r in rows])  # noqa: E731
    return Rollout([r["prompt"] for r in rows], [r["completion"] for r in rows], stack("input_ids"),
                   stack("attention_mask"), width, stack("mask"), stack("old_logprobs"), stack("ref_logprobs"),
                   stack("values"), stack("scores"), stack("truncated"))
