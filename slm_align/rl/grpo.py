"""GRPO inside the safety envelope: no value head, advantages relative to a group of completions of
one prompt.

One iteration, top to bottom:

1. prompts: ``prompts_per_step`` training prompts, each repeated ``group_size`` times (a group,
   contiguous);
2. rollout: sample, score, and recompute old/reference log-probabilities in fp32 (each pass only
   when something uses it);
3. all-equal groups: a group whose rewards do not differ carries no signal; counted,
   (``resample_zero_std``) sampled once more, and (``refill_flat``, DAPO's dynamic sampling)
   replaced by groups of new prompts;
4. advantages: sigma-clip the raw scores over the batch, then normalise within each group;
5. update: ``epochs`` passes in shuffled minibatches, each in micro-batches: the ratio, the loss
   (the clipped policy loss with an asymmetric clip plus beta times the k3 KL to the reference,
   both normalised by ``loss_type`` over the minibatch) and its backward; then the ratio guard,
   the guarded optimizer step;
6. metrics, the share of all-equal groups among them.

After Shao et al. 2024 (DeepSeekMath, GRPO), Yu et al. 2025 (DAPO: clip-higher) and Liu et al.
2025 (Dr. GRPO), as TRL's GRPOTrainer; laid out as CleanRL's ``ppo.py``.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from slm_align.config import RLSettings
from slm_align.envelope.seeds import derive_seed
from slm_align.rl.advantages import Advantages, all_equal_groups, grpo_advantages
from slm_align.rl.learner import Learner, PolicyForward, rollout_kl, rollout_metrics
from slm_align.rl.losses import Whole, aggregate, clipped_policy_loss, kl_k3
from slm_align.rl.schedule import IterationSize
from slm_align.rollouts.completions import Passes, Rollout, replace_rows
from slm_align.rollouts.phases import PhaseClock


class GRPO(Learner):
    """GRPO's iteration on the shared run state (:class:`slm_align.rl.learner.Learner`); no value
    head."""

    draw_unit = "prompts"

    @classmethod
    def iteration_size(cls, settings: RLSettings) -> IterationSize:
        """``prompts_per_step`` prompts, each sampled ``group_size`` times (a group)."""
        return IterationSize(settings.prompts_per_step, settings.group_size)

    def kl_weight(self) -> float:
        """The recipe's beta (as the watchdog last scaled it)."""
        return self.settings.grpo.beta

    def raise_kl(self, factor: float, base_beta: float, scale: float) -> None:
        self.rescale_kl(base_beta, scale)

    def rescale_kl(self, base_beta: float, scale: float) -> None:
        grpo = self.settings.grpo.model_copy(update={"beta": base_beta * scale})
        self.settings = self.settings.model_copy(update={"grpo": grpo})

    def needs_old_pass(self) -> bool:
        """Only when an epoch takes several minibatches (the second is scored after the first
        step). With one minibatch per epoch, the first epoch's forward comes before any step: its
        log-probabilities, detached, are the old ones, and the later epochs reuse them (TRL skips
        the pass only for a single step)."""
        size = self.iteration_size(self.settings)
        rows = size.prompts // self.world.size * size.completions_per_prompt
        return self.settings.minibatch_size < rows

    def needs_reference(self) -> bool:
        """Only when the loss weighs the KL (beta > 0) or the watchdog watches it: no reference
        pass otherwise (TRL skips it at beta 0 too)."""
        return self.settings.grpo.beta > 0 or self.kl_watched

    def old_from_sampler(self) -> bool:
        """Whether the old log-probabilities, when needed, are the ones PyTorch's sampler drew each
        token with (:func:`~slm_align.rollouts.completions.sampled_old_logprobs`) instead of a pass of their own:
        ``rl.old_logprobs = "sampler"`` (the default), PyTorch samples (llama.cpp's are another
        engine's), in fp32 (under bf16 autocast the cached decode and a full forward round apart by
        more than fp32 does)."""
        fp32 = self.precision == "fp32" and not torch.is_autocast_enabled(self.device.type)
        return self.settings.old_logprobs == "sampler" and self.sampler is None and fp32

    def sample(self, prompts: list[str], seed: int) -> Rollout:
        """One completion per prompt (``seed``), scored, with the log-probability passes GRPO
        uses."""
        passes = Passes(self.needs_old_pass(), self.needs_reference(), self.old_from_sampler())
        return self.collect_rollout(prompts, seed, passes)

    def rollout(self, step: int) -> Rollout:
        """The groups of an iteration (B = prompts x G rows): all-equal ones drawn once more when
        asked (``resample_zero_std``), then replaced by new prompts' groups (``refill_flat``). How
        many groups the first draw had all equal is the rollout's ``all_equal`` (it measures the
        policy); how many were replaced by new prompts, its ``refilled``."""
        group, rank = self.settings.group_size, self.world.rank
        prompts = self.prompts_for(step)
        batch = self.sample(prompts, derive_seed(self.seed, "rollout", step, rank))
        # --- all-equal groups: reward std below ZERO_STD, no signal
        flat = all_equal_groups(batch.scores, group)
        first_flat = len(flat)
        if flat and self.settings.grpo.resample_zero_std:
            same = [prompts[g * group] for g in flat]
            batch = self.redraw(batch, flat, same, derive_seed(self.seed, "resample", step, rank))
        batch, refilled = self.refill(batch, step)
        batch.all_equal, batch.refilled = first_flat, refilled
        return batch

    def refill(self, batch: Rollout, step: int) -> tuple[Rollout, int]:
        """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, "over-sample and filter out prompts
        with accuracy 1 and 0"): in up to ``refill_flat`` more draws, each group still all-equal is
        replaced, in place, by a group of a newly drawn training prompt, so that the update
        holds groups with a signal. The batch keeps its size (DAPO draws until the batch is full; a
        round cap bounds an iteration's sampling, whatever the reward). Returns the batch and how
        many groups were replaced."""
        group, rank = self.settings.group_size, self.world.rank
        refilled = 0
        for round_ in range(self.settings.grpo.refill_flat):
            flat = all_equal_groups(batch.scores, group)
            if not flat:
                break
            fresh = self.draw_prompts(derive_seed(self.seed, "refill_prompts", step, rank, round_), len(flat))
            batch = self.redraw(batch, flat, fresh, derive_seed(self.seed, "refill", step, rank, round_))
            refilled += len(flat)
        return batch, refilled

    def redraw(self, batch: Rollout, groups: list[int], prompts: list[str], seed: int) -> Rollout:
        """``batch`` with each of its ``groups`` (indices) replaced by a new group of the prompt in
        ``prompts`` at the same position, sampled with ``seed``."""
        size = self.settings.group_size
        rows = [g * size + k for g in groups for k in range(size)]
        redo = self.sample([prompt for prompt in prompts for _ in range(size)], seed)
        return replace_rows(batch, rows, redo, self.tokenizer.pad_token_id)

    def advantages(self, batch: Rollout) -> Advantages:
        """(B, T) advantages: A_i on every completion token of row i; no returns (no value head).

        A = group_normalise(clip3sigma(scores)) (:func:`grpo_advantages`). Clipping the raw scores
        before the group normalisation keeps a lone success's advantage and every group's zero sum.
        """
        grpo = self.settings.grpo
        per_sequence, clipped = grpo_advantages(batch.scores, self.settings.group_size,
                                                grpo.scale_rewards, self.envelope.sigma_clip)
        self.counters.score_clipped += clipped
        return Advantages(per_sequence.unsqueeze(-1) * batch.mask)

    def minibatch(self, batch: Rollout, rows: torch.Tensor, adv: Advantages) -> dict:
        """One guarded optimizer step on ``rows`` (b,) of the rollout, in micro-batches
        (:meth:`~slm_align.rl.learner.Learner.guarded_update`); its statistics."""
        return self.guarded_update(batch, rows, partial(self.loss, batch, adv))

    def loss(self, batch: Rollout, adv: Advantages, fwd: PolicyForward, whole: Whole) -> tuple[torch.Tensor, dict]:
        """The minibatch's loss on ``fwd``'s rows (a micro-batch of it, the minibatch ``whole``).

        loss = agg(L_clip(rho, A)) + beta * agg(k3), over the (b, T) completion tokens: L_clip the
        clipped surrogate with DAPO's clip-higher range [1 - clip_eps, 1 + clip_eps_high]
        (:func:`clipped_policy_loss`); k3 = exp(d) - 1 - d, d = log pi_ref - log pi (:func:`kl_k3`);
        agg the ``loss_type`` normalisation over the whole minibatch (:func:`aggregate`), so that
        the micro-batches' losses add up to it. Shao et al. 2024, eq. 3.
        """
        s, grpo = self.settings, self.settings.grpo
        low, high = s.clip_eps, grpo.clip_eps_high  # clip-higher: a rare token may rise further
        loss, clip_frac = clipped_policy_loss(fwd.ratio, adv.tokens[fwd.rows], fwd.mask, (low, high),
                                              grpo.loss_type, self.token_budget(), fwd.weights, whole)
        stats = {"loss/policy": float(loss.detach()), "clip_frac": float(clip_frac)}
        if grpo.beta:
            kl = kl_k3(fwd.logprobs, batch.ref_logprobs[fwd.rows], self.envelope.log_ratio_clamp)
            loss = loss + grpo.beta * aggregate(kl, fwd.mask, grpo.loss_type, self.token_budget(), whole)
        return loss, stats

    def run_step(self, step: int) -> dict:
        """One GRPO iteration: groups, advantages, guarded updates; the iteration's metrics."""
        started = time.perf_counter()
        self.clock = PhaseClock()
        # --- rollout (its all-equal groups counted, and drawn again when asked)
        batch = self.rollout(step)
        zero_std_frac = zero_std_share(batch.all_equal, self.settings.prompts_per_step, self.world)
        self.require_training_tokens(batch, step)
        # --- advantages
        adv = self.advantages(batch)
        # --- update: ``epochs`` seeded shuffles of the rollout, a guarded step per minibatch,
        # at the iteration's learning rate (warmup, the watchdog's scale)
        self.set_learning_rate()
        results = [self.minibatch(batch, rows, adv) for rows in self.minibatches(batch, step)]
        self.step = step + 1
        metrics = rollout_metrics(batch, results, rollout_kl(batch), time.perf_counter() - started)
        metrics.update(self.run_metrics())
        metrics["grpo/zero_std_frac"] = zero_std_frac
        if self.settings.grpo.refill_flat:
            metrics["grpo/refilled_groups"] = float(batch.refilled)
            metrics["grpo/trained_zero_std_frac"] = zero_std_share(
                len(all_equal_groups(batch.scores, self.settings.group_size)), self.settings.prompts_per_step,
                self.world)
        metrics.update(self.sampler_figures(batch))
        return metrics


def zero_std_share(all_equal: int, prompts_per_step: int, world) -> float:
    """The share of the iteration's groups, on every rank, whose rewards are all equal: each rank's count over
    its own prompts (``prompts_per_step // world.size``), averaged over the ranks. (This rank's count over every
    rank's prompts capped the share at 1 / ranks, and the starving-groups detector could never fire.)"""
    local_prompts = max(1, prompts_per_step // world.size)
    return world.mean(all_equal / local_prompts)
