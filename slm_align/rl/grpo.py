"""GRPO inside the safety envelope: no value head, advantages relative to a group of completions of one prompt.

One iteration, top to bottom:

1. prompts: ``prompts_per_step`` training prompts, each repeated ``group_size`` times (a group, contiguous);
2. rollout: sample, score, and recompute old/reference log-probabilities in fp32;
3. all-equal groups: a group whose rewards do not differ carries no signal; counted, and (``resample_zero_std``)
   sampled once more;
4. advantages: sigma-clip the raw scores over the batch, then normalise within each group;
5. loss, per minibatch (through the shared guarded step): the clipped policy loss with an asymmetric clip,
   normalised by ``loss_type``, plus beta times the k3 KL to the reference;
6. metrics, the share of all-equal groups among them.

After Shao et al. 2024 (DeepSeekMath, GRPO), Yu et al. 2025 (DAPO: clip-higher) and Liu et al. 2025 (Dr. GRPO),
as TRL's GRPOTrainer.
"""

from __future__ import annotations

import time

import torch

from slm_align.envelope.seeds import derive_seed
from slm_align.rl.advantages import all_equal_groups, grpo_advantages
from slm_align.rl.losses import aggregate, clipped_policy_loss, kl_k3
from slm_align.rl.phases import PhaseClock
from slm_align.rl.rollout import Rollout, replace_rows
from slm_align.rl.schedule import iteration_size
from slm_align.rl.step import Learner, LossFn, rollout_kl, rollout_metrics


class GRPO(Learner):
    """GRPO's iteration on the shared run state (:class:`slm_align.rl.step.Learner`); no value head."""

    def prompts_for(self, step: int) -> list[str]:
        """This rank's prompts of an iteration, each ``group_size`` times in a row, chosen by (seed, step)."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", step))
        size = iteration_size(self.settings)
        picks = torch.randint(len(self.train_prompts), (size.prompts,), generator=generator).tolist()
        picks = picks[self.world.rank::self.world.size]  # this rank's share: whole groups
        return [self.train_prompts[i] for i in picks for _ in range(size.completions_per_prompt)]

    def needs_old_pass(self) -> bool:
        """Only when an epoch takes several minibatches (the second is scored after the first step). With one
        minibatch per epoch, the first epoch's forward comes before any step: its log-probabilities, detached, are
        the old ones, and the later epochs reuse them (TRL skips the pass only for a single step)."""
        size = iteration_size(self.settings)
        rows = size.prompts // self.world.size * size.completions_per_prompt
        return self.settings.minibatch_size < rows

    def needs_reference(self) -> bool:
        """Only when the loss weighs the KL (beta > 0) or the watchdog watches it: no reference pass otherwise
        (TRL skips it at beta 0 too)."""
        return self.settings.grpo.beta > 0 or self.kl_watched

    def rollout(self, step: int) -> tuple[Rollout, int]:
        """The groups of an iteration, all-equal ones drawn once more when asked; and how many were all equal."""
        group = self.settings.group_size
        prompts = self.prompts_for(step)
        seed = derive_seed(self.seed, "rollout", step, self.world.rank)
        batch = self.sample_rollout(prompts, seed)
        flat = all_equal_groups(batch.scores, group)
        if flat and self.settings.grpo.resample_zero_std:
            rows = [g * group + k for g in flat for k in range(group)]
            seed = derive_seed(self.seed, "resample", step, self.world.rank)
            redo = self.sample_rollout([prompts[i] for i in rows], seed)
            batch = replace_rows(batch, rows, redo, self.tokenizer.pad_token_id)
        return batch, len(flat)

    def advantages(self, batch: Rollout) -> torch.Tensor:
        """(B, T) advantages: the raw scores sigma-clipped over the batch, normalised in groups, on every token.

        Clipping before the group normalisation keeps a lone success's advantage and every group's zero sum."""
        grpo = self.settings.grpo
        per_sequence, clipped = grpo_advantages(batch.scores, self.settings.group_size, grpo.scale_rewards,
                                                self.envelope.sigma_clip)
        self.counters.score_clipped += clipped
        return per_sequence.unsqueeze(-1) * batch.mask

    def loss(self, batch: Rollout, advantages: torch.Tensor) -> LossFn:
        """GRPO's loss on a minibatch: the clipped policy loss (clip 1 - clip_eps .. 1 + clip_eps_high) plus
        beta * k3 KL, both normalised by ``loss_type``."""
        s = self.settings

        def loss_fn(rows, new_logprobs, values, ratio, mask):
            """GRPO's loss on ``rows`` (see :data:`slm_align.rl.step.LossFn`) and its statistics."""
            loss, clip_frac = clipped_policy_loss(ratio, advantages[rows], mask, s.clip_eps, s.grpo.clip_eps_high,
                                                  s.grpo.loss_type, s.max_new_tokens)
            stats = {"loss/policy": float(loss.detach()), "clip_frac": float(clip_frac)}
            if s.grpo.beta:
                kl = kl_k3(new_logprobs, batch.ref_logprobs[rows], self.envelope.log_ratio_clamp)
                loss = loss + s.grpo.beta * aggregate(kl, mask, s.grpo.loss_type, s.max_new_tokens)
            return loss, stats

        return loss_fn

    def run_step(self, step: int) -> dict:
        """One GRPO iteration: groups, advantages, guarded updates; the iteration's metrics."""
        started = time.perf_counter()
        self.clock = PhaseClock()
        batch, all_equal = self.rollout(step)
        self.require_training_tokens(batch, step)
        advantages = self.advantages(batch)
        results = self.update(batch, self.loss(batch, advantages), step)
        self.step = step + 1
        metrics = rollout_metrics(batch, results, rollout_kl(batch), time.perf_counter() - started)
        metrics.update(self.guard_metrics())
        metrics.update(self.clock.metrics())
        metrics["grpo/zero_std_frac"] = all_equal / max(1, self.settings.prompts_per_step)
        return metrics
