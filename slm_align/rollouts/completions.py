"""Rollouts: sample with the KV cache, then recompute log-probabilities under policy
and reference in fp32."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from slm_align.config import RLSettings
from slm_align.envelope.logprobs import forward_logprobs
from slm_align.envelope.policy import merged_for_sampling
from slm_align.envelope.value_head import ValueHead
from slm_align.modeling.accelerator import device_of
from slm_align.modeling.generation import sample, score
from slm_align.rollouts.phases import PhaseClock


@dataclass
class Rollout:
    """A batch of sampled completions with everything the update needs."""

    prompts: list[str]
    completions: list[str]
    input_ids: torch.Tensor  # (B, P+T): left-padded prompt, then completion
    attention_mask: torch.Tensor  # (B, P+T)
    prompt_width: int
    mask: torch.Tensor  # (B, T) float: completion tokens that train
    old_logprobs: Optional[torch.Tensor]  # (B, T); None until the first epoch's forward supplies them (one minibatch)
    ref_logprobs: Optional[torch.Tensor]  # (B, T); None when nothing uses them (GRPO, beta 0, KL unwatched)
    values: Optional[torch.Tensor]  # (B, T), PPO only
    scores: torch.Tensor  # (B,) reward of each completion (after any length penalty)
    truncated: torch.Tensor  # (B,) bool
    all_equal: int = 0  # GRPO: groups whose first draw's rewards were all equal (no signal)
    refilled: int = 0  # GRPO: all-equal groups replaced by new prompts' groups (refill_flat)
    stats: dict = field(default_factory=dict)  # metrics of the rollout itself (agent episodes': call rate, ...)
    sampler_logprobs: Optional[torch.Tensor] = None  # (B, T) another engine's log-probs of its tokens (llama.cpp)
    round_tokens: Optional[list[list[int]]] = None  # per row, tokens sampled in each round (agent episodes)

    @property
    def size(self) -> int:
        """B, the rollout's rows (completions)."""
        return self.scores.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) completion tokens of each row (EOS included, padding not)."""
        return self.attention_mask[:, self.prompt_width:].sum(-1)

    @property
    def round_lengths(self) -> torch.Tensor:
        """(B,) float tokens sampled per round of each row: :attr:`lengths` for single completions
        (one round), for an agent episode its sampled tokens over its rounds (tool rounds and the
        answer), the tool results the runtime inserted not counted: the ``completion/length`` the
        watchdog watches, which an agent that learns to call tools does not inflate."""
        if self.round_tokens is None:
            return self.lengths.float()
        per_round = [sum(rounds) / len(rounds) if rounds else 0.0 for rounds in self.round_tokens]
        return torch.tensor(per_round, dtype=torch.float32, device=self.scores.device)


@dataclass(frozen=True)
class RolloutModels:
    """What a rollout samples, scores and rewards with."""

    policy: object
    """The policy (a fresh LoRA on the merged prior); its adapter disabled is the reference."""
    value_head: Optional[ValueHead]
    """PPO's critic, whose values the old pass computes too (None: no values)."""
    tokenizer: object
    """The policy's tokenizer (its pad id pads the rows)."""
    reward_fn: object
    """The reward, TRL's ``fn(prompts, completions, **columns)``."""
    sampler: object = None
    """A :class:`~slm_align.rl.llama_sampler.LlamaSampler` that draws instead of PyTorch (None:
    PyTorch samples)."""


@dataclass(frozen=True)
class Passes:
    """Which no-gradient log-probability passes a rollout runs (each only when something uses
    it)."""

    old: bool = True
    """The old policy's log-probabilities (off: the first epoch's forward supplies them, one
    minibatch per epoch; with a value head the pass runs anyway, for the values)."""
    reference: bool = True
    """The reference's (the adapter disabled); off when nothing uses them."""
    old_from_sampler: bool = False
    """Take the old log-probabilities from PyTorch's sampler instead of a pass of their own
    (PyTorch sampling in fp32, no value head; :func:`sampled_old_logprobs`)."""


def collect(models: RolloutModels, prompts: list[str], settings: RLSettings, seed: int,
            clock: Optional[PhaseClock] = None, passes: Passes = Passes()) -> Rollout:
    """Sample one completion per prompt (``seed``), score it, and recompute its
    log-probabilities in fp32 under the policy (with values, when there is a value head) and the
    reference (the adapter disabled), as ``passes`` asks (a pass off leaves its tensor None).

    ``clock`` times the phases. ``models.sampler`` draws the completions instead of PyTorch, with
    its own log-probabilities kept as ``sampler_logprobs``.
    """
    clock = clock or PhaseClock()
    policy = models.policy
    sampler = models.sampler
    policy.eval()
    from_sampler = (passes.old and passes.old_from_sampler and sampler is None
                    and models.value_head is None)
    samples = draw(policy, models.tokenizer, prompts, settings, seed, clock, sampler,
                   with_logprobs=from_sampler)
    packed = Packed(torch.cat([samples.prompt_ids, samples.completion_ids], dim=1),
                    torch.cat([samples.prompt_mask, samples.completion_mask], dim=1),
                    samples.prompt_ids.shape[1])
    old, ref, values = scoring_passes(policy, models.value_head, packed, settings, clock,
                                      replace(passes, old=passes.old and not from_sampler))
    if from_sampler:
        old = sampled_old_logprobs(samples)
    device = packed.input_ids.device
    truncated = torch.tensor(samples.truncated, device=device)
    with clock.phase("reward"):
        raw = torch.tensor(score(models.reward_fn, samples), dtype=torch.float32, device=device)
    scores, mask = truncation_rules(raw, samples.completion_mask.float(), truncated, settings)
    drawn = samples.logprobs if sampler is not None else None
    return Rollout(prompts, samples.completions, packed.input_ids, packed.attention_mask,
                   packed.prompt_width, mask, old, ref, values, scores, truncated,
                   sampler_logprobs=drawn)


def sampled_old_logprobs(samples) -> torch.Tensor:
    """(B, T) fp32 old log-probabilities of a PyTorch rollout, taken from its sampler: the same quantity the
    old pass recomputes, log pi_old(y_t) = log softmax(z_t / tau)[y_t], z_t = W h_t, where the sampler's
    z_t came out of the cached decode through the LoRA merged into the weights
    (:func:`~slm_align.envelope.policy.merged_for_sampling`) and the pass's out of one forward through
    the LoRA path; the two differ by fp32 rounding only (on the real Gemma 3 270M at most 5e-5 nats a
    token, docs/benchmarks.md). 0 after a row's EOS, where the mask is 0.

    Every token's full-vocabulary logits already exist while it is drawn, so this saves the old pass: a
    decoder forward and the (B x T, V) vocabulary projection of the whole rollout, about one eighth of
    a GRPO iteration on Gemma 3 270M at 8 x 4 (TRL recomputes them in a pass of their own)."""
    return samples.logprobs.float()


def draw(policy, tokenizer, prompts: list[str], settings: RLSettings, seed: int, clock: PhaseClock, sampler=None,
         with_logprobs: bool = False):
    """The rollout's completions: PyTorch's through the policy's merged weights (with the log-probabilities
    it drew each token with when ``with_logprobs``), or ``sampler``'s with the current LoRA swapped in
    first."""
    if sampler is None:
        with clock.phase("sampling"), merged_for_sampling(policy):
            return sample(policy, tokenizer, prompts, settings.max_new_tokens, settings.temperature, seed=seed,
                          with_logprobs=with_logprobs)
    with clock.phase("sampler_sync"):
        sampler.refresh(policy)
    with clock.phase("sampling"):
        drawn = sampler.sample(tokenizer, prompts, settings.max_new_tokens, settings.temperature, seed)
    device = device_of(policy)  # llama.cpp's tokens come back on the CPU; the policy may train on a GPU
    return replace(drawn, prompt_ids=drawn.prompt_ids.to(device), prompt_mask=drawn.prompt_mask.to(device),
                   completion_ids=drawn.completion_ids.to(device), completion_mask=drawn.completion_mask.to(device),
                   logprobs=drawn.logprobs.to(device))


@dataclass(frozen=True)
class Packed:
    """Sampled rows laid out for a forward pass: left-padded prompts, then the sampled part."""

    input_ids: torch.Tensor
    """(B, P+T) token ids."""
    attention_mask: torch.Tensor
    """(B, P+T) 1 on real tokens."""
    prompt_width: int
    """P, the prompts' padded width."""


def scoring_passes(policy, value_head: Optional[ValueHead], packed: Packed, settings: RLSettings,
                   clock: PhaseClock, passes: Passes):
    """``(old, ref, values)`` of the sampled rows, (B, T) each or None, without gradient: the old
    log-probabilities (and values) when ``passes.old`` or a value head asks for them, the
    reference's (the adapter disabled) when ``passes.reference`` does."""
    old = None
    values = None
    ref = None
    rows = (packed.input_ids, packed.attention_mask, packed.prompt_width, settings)
    with torch.no_grad():
        if passes.old or value_head is not None:
            with clock.phase("scoring_old"):
                old, values = _logprobs_and_values(policy, *rows, value_head)
        if passes.reference:
            with clock.phase("scoring_ref"), policy.disable_adapter():
                ref, _ = _logprobs_and_values(policy, *rows)
    return old, ref, values


def truncation_rules(scores: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor, settings: RLSettings,
                     round_tokens: Optional[list[list[int]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the recipe does to long and truncated rows: the scores (B,) less the length penalty and
    the missing-EOS penalty, and the mask with truncated rows zeroed under ``mask_truncated``.

    The length penalty is ``length_penalty`` per sampled token past 80% of ``max_new_tokens`` in each
    round (:func:`tokens_over`): one completion's tokens counted on ``mask`` (B, T), an agent
    episode's per round in ``round_tokens``, since the budget is each round's."""
    if settings.length_penalty:
        over = tokens_over(mask, round_tokens, 0.8 * settings.max_new_tokens)
        scores = scores - settings.length_penalty * over
    scores = scores - settings.missing_eos_penalty * truncated.float()
    if settings.mask_truncated:
        mask = mask * (~truncated).float().unsqueeze(-1)
    return scores, mask


def tokens_over(mask: torch.Tensor, round_tokens: Optional[list[list[int]]], allowed: float) -> torch.Tensor:
    """(B,) sampled tokens past ``allowed`` per round, summed over each row's rounds:
    sum_r max(0, n_r - allowed). ``round_tokens`` None: one round of ``mask.sum(-1)`` tokens per row
    ((B, T) mask); else the tokens of each round of each row (an agent episode's)."""
    if round_tokens is None:
        return (mask.sum(-1) - allowed).clamp(min=0)
    over = [sum(max(0.0, count - allowed) for count in rounds) for rounds in round_tokens]
    return torch.tensor(over, dtype=mask.dtype, device=mask.device)


def _logprobs_and_values(policy, input_ids, attention, width: int, settings: RLSettings, value_head=None):
    """Log-probs (and values) of the samples, a minibatch at a time: the full-vocabulary tensors of
    one minibatch are alive at once, not those of the whole rollout (with a 49k vocabulary that was
    1.1 GB more than TRL)."""
    size = settings.minibatch_size
    parts = [forward_logprobs(policy, input_ids[i:i + size], attention[i:i + size], width, settings.temperature,
                              value_head, with_entropy=False) for i in range(0, input_ids.shape[0], size)]
    values = torch.cat([part[2] for part in parts]) if value_head is not None else None
    return torch.cat([part[0] for part in parts]), values


def _pad_to(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    pad = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def _padded_tokens(t: Optional[torch.Tensor], i: int, length: int) -> Optional[torch.Tensor]:
    """Row ``i`` of a (B, T) per-token tensor right-padded with zeros to ``length``
    tokens (None stays None)."""
    if t is None:
        return None
    return _pad_to(t[i:i + 1], length, 0.0, False)


def _row(r: Rollout, i: int, width: int, length: int, pad_id: int) -> dict:
    """Row ``i`` of a rollout re-padded to a prompt ``width`` (left) and
    completion ``length`` (right)."""
    prompt = slice(None, r.prompt_width)
    completion = slice(r.prompt_width, None)
    ids = r.input_ids[i:i + 1]
    att = r.attention_mask[i:i + 1]
    return {
        "input_ids": torch.cat([_pad_to(ids[:, prompt], width, pad_id, True),
                                _pad_to(ids[:, completion], length, pad_id, False)], 1),
        "attention_mask": torch.cat([_pad_to(att[:, prompt], width, 0, True),
                                     _pad_to(att[:, completion], length, 0, False)], 1),
        "mask": _padded_tokens(r.mask, i, length), "old_logprobs": _padded_tokens(r.old_logprobs, i, length),
        "ref_logprobs": _padded_tokens(r.ref_logprobs, i, length), "values": _padded_tokens(r.values, i, length),
        "sampler_logprobs": _padded_tokens(r.sampler_logprobs, i, length),
        "scores": r.scores[i:i + 1], "truncated": r.truncated[i:i + 1],
        "prompt": r.prompts[i], "completion": r.completions[i],
        "round_tokens": r.round_tokens[i] if r.round_tokens is not None else [int(r.lengths[i])],
    }


def _stack(rows: list[dict], key: str) -> Optional[torch.Tensor]:
    """The rows' ``key`` tensors stacked into a batch (None when the rollout has none,
    as values under GRPO)."""
    if rows[0][key] is None:
        return None
    return torch.cat([r[key] for r in rows])


def replace_rows(batch: Rollout, rows: list[int], replacement: Rollout, pad_id: int) -> Rollout:
    """``batch`` with its ``rows`` replaced, in order, by the rows of ``replacement`` (one each).

    Prompts are re-padded on the left and completions on the right to the wider of the two rollouts,
    so the other rows keep their places (GRPO groups stay contiguous). The rollout's ``stats`` stay
    those of ``batch``: the first draw is what measures the policy (a redraw picks rows by outcome).
    """
    width = max(batch.prompt_width, replacement.prompt_width)
    length = max(batch.mask.shape[1], replacement.mask.shape[1])
    replaced = set(rows)
    replacements = iter(range(len(replacement.prompts)))
    merged = []
    for i in range(len(batch.prompts)):
        if i in replaced:
            merged.append(_row(replacement, next(replacements), width, length, pad_id))
        else:
            merged.append(_row(batch, i, width, length, pad_id))
    episodes = batch.round_tokens is not None or replacement.round_tokens is not None
    return Rollout([r["prompt"] for r in merged], [r["completion"] for r in merged], _stack(merged, "input_ids"),
                   _stack(merged, "attention_mask"), width, _stack(merged, "mask"), _stack(merged, "old_logprobs"),
                   _stack(merged, "ref_logprobs"), _stack(merged, "values"), _stack(merged, "scores"),
                   _stack(merged, "truncated"), stats=dict(batch.stats),
                   sampler_logprobs=_stack(merged, "sampler_logprobs"),
                   round_tokens=[r["round_tokens"] for r in merged] if episodes else None)
