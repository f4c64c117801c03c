"""Rollouts: sample with the KV cache, then recompute log-probabilities under policy and reference in fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from slm_align.config import RLSettings
from slm_align.generation import sample
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
        old, _, values = forward_logprobs(policy, input_ids, attention, width, settings.temperature, value_head)
        with policy.disable_adapter():
            ref, _, _ = forward_logprobs(policy, input_ids, attention, width, settings.temperature)
    scores = torch.tensor(reward_fn(prompts, samples.completions), dtype=torch.float32)
    lengths = samples.completion_mask.sum(-1).float()
    if settings.length_penalty:
        scores = scores - settings.length_penalty * (lengths - 0.8 * settings.max_new_tokens).clamp(min=0)
    truncated = torch.tensor(samples.truncated)
    mask = samples.completion_mask.float()
    if settings.mask_truncated:
        mask = mask * (~truncated).float().unsqueeze(-1)
    return Rollout(prompts, samples.completions, input_ids, attention, width, mask, old, ref, values, scores,
                   truncated)


def _pad_to(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    pad = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat(first: Rollout, keep: list[int], second: Rollout, pad_id: int) -> Rollout:
    """Rows ``keep`` of ``first`` followed by all of ``second`` (prompt parts re-padded left, completions right).

    Row order is restored so that GRPO groups stay contiguous: ``second`` replaces the rows not kept.
    """
    width = max(first.prompt_width, second.prompt_width)
    length = max(first.mask.shape[1], second.mask.shape[1])

    def parts(r: Rollout, rows):
        p, c = r.input_ids[rows, :r.prompt_width], r.input_ids[rows, r.prompt_width:]
        pm, cm = r.attention_mask[rows, :r.prompt_width], r.attention_mask[rows, r.prompt_width:]
        ids = torch.cat([_pad_to(p, width, pad_id, True), _pad_to(c, length, pad_id, False)], 1)
        att = torch.cat([_pad_to(pm, width, 0, True), _pad_to(cm, length, 0, False)], 1)
        per_token = [None if t is None else _pad_to(t[rows], length, 0.0, False)
                     for t in (r.mask, r.old_logprobs, r.ref_logprobs, r.values)]
        return ids, att, per_token

    replaced = [i for i in range(len(first.prompts)) if i not in set(keep)]
    order = sorted(range(len(first.prompts)), key=lambda i: i)
    a, b = parts(first, keep), parts(second, list(range(len(second.prompts))))
    position = {row: ("a", k) for k, row in enumerate(keep)}
    position.update({row: ("b", k) for k, row in enumerate(replaced)})
    pick = lambda ta, tb: torch.stack([(ta if position[i][0] == "a" else tb)[position[i][1]] for i in order])
    texts = lambda la, lb: [(la if position[i][0] == "a" else lb)[position[i][1]] for i in order]
    per_token = [None if ta is None else pick(ta, tb) for ta, tb in zip(a[2], b[2])]
    return Rollout(texts([first.prompts[k] for k in keep], second.prompts),
                   texts([first.completions[k] for k in keep], second.completions),
                   pick(a[0], b[0]), pick(a[1], b[1]), width, per_token[0], per_token[1], per_token[2], per_token[3],
                   pick(first.scores[keep], second.scores), pick(first.truncated[keep], second.truncated))
