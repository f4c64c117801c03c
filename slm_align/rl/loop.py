"""The shared PPO/GRPO loop. Readable top to bottom: rollout, advantages, guarded minibatch updates.

Every part of the safety envelope acts here and is counted: fp32 ratios with a clamped log-ratio, sigma
clipping of scores and advantages, the importance-ratio guard (skip: no optimizer step), and rollback of
parameters and optimizer state on any non-finite loss, gradient or parameter.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Optional

import torch

from slm_align.config import RLSettings
from slm_align.errors import UserError
from slm_align.rl.advantages import gae, grpo_advantages, masked_mean, masked_whiten, per_token_rewards, sigma_clip
from slm_align.rl.distributed import World
from slm_align.rl.learning_rate import base_parameters, default_learning_rate
from slm_align.rl.losses import adaptive_kl_coef, aggregate, clipped_policy_loss, clipped_value_loss, kl_k3, ratio_of
from slm_align.rl.policy import ValueHead, forward_logprobs
from slm_align.rl.rollout import Rollout, collect, concat
from slm_align.rl.safeguards import GuardCounters, Snapshot, all_finite


class RLLoop:
    """State of one RL run: policy, optional value head, optimizer, KL coefficient, guard counters."""

    def __init__(self, policy, tokenizer, reward_fn, train_prompts: list[str], settings: RLSettings, seed: int,
                 value_head: Optional[ValueHead] = None, world: World = World()):
        self.policy, self.tokenizer, self.reward_fn, self.world = policy, tokenizer, reward_fn, world
        self.train_prompts, self.settings, self.seed, self.value_head = train_prompts, settings, seed, value_head
        self.envelope = settings.envelope
        self.named_params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        if value_head is not None:
            self.named_params += [(f"value_head.{n}", p) for n, p in value_head.named_parameters()]
        self.params = [p for _, p in self.named_params]
        self.learning_rate = settings.learning_rate
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(base_parameters(policy))
        self.optimizer = torch.optim.AdamW(self.params, lr=self.learning_rate, weight_decay=0.0)
        self.kl_coef = settings.kl_coef
        self.counters = GuardCounters()
        self.step = 0

    @property
    def grpo(self) -> bool:
        return self.settings.algo == "grpo"

    # ---- rollout -------------------------------------------------------------------------------------------
    def prompts_for(self, step: int) -> list[str]:
        """Training prompts of an iteration, chosen by (seed, step) so that a resumed run sees the same ones."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        # Both algorithms see prompts_per_step * group_size sequences: GRPO as groups, PPO as distinct prompts.
        draws = self.settings.prompts_per_step * (1 if self.grpo else self.settings.group_size)
        picks = torch.randint(len(self.train_prompts), (draws,), generator=generator).tolist()
        picks = picks[self.world.rank::self.world.size]  # this rank's share (whole GRPO groups)
        repeat = self.settings.group_size if self.grpo else 1
        return [self.train_prompts[i] for i in picks for _ in range(repeat)]

    def rollout(self, step: int) -> tuple[Rollout, int]:
        prompts = self.prompts_for(step)
        seed = self.seed * 7919 + step + 100_003 * self.world.rank
        batch = collect(self.policy, self.value_head, self.tokenizer, self.reward_fn, prompts, self.settings, seed)
        if not self.grpo:
            return batch, 0
        zero = self._zero_std_groups(batch)
        if zero and self.settings.resample_zero_std:
            rows = [g * self.settings.group_size + k for g in zero for k in range(self.settings.group_size)]
            redo = collect(self.policy, self.value_head, self.tokenizer, self.reward_fn, [prompts[i] for i in rows],
                           self.settings, seed + 104729)
            keep = [i for i in range(len(prompts)) if i not in set(rows)]
            batch = concat(batch, keep, redo, self.tokenizer.pad_token_id)
        return batch, len(zero)

    def _zero_std_groups(self, batch: Rollout) -> list[int]:
        groups = batch.scores.view(-1, self.settings.group_size)
        return [g for g in range(groups.shape[0]) if float(groups[g].std()) < 1e-6]

    # ---- advantages ----------------------------------------------------------------------------------------
    def advantages(self, batch: Rollout) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Per-token advantages (and PPO's returns), whitened and sigma-clipped as the envelope says.

        GRPO clips the raw scores over the batch, then normalises within groups: a lone success keeps its
        advantage and every group still sums to zero. PPO clips the whitened scores and the advantages.
        """
        n_sigma, mask = self.envelope.sigma_clip, batch.mask
        if self.grpo:
            per_sequence, clipped = grpo_advantages(batch.scores, self.settings.group_size, self.settings.scale_rewards,
                                                    n_sigma)
            self.counters.score_clipped += clipped
            return per_sequence.unsqueeze(-1) * mask, None
        scores = batch.scores
        if self.settings.whiten_rewards and scores.numel() > 1:
            scores = (scores - scores.mean()) / (scores.std() + 1e-8)
        scores, clipped = sigma_clip(scores, n_sigma)
        self.counters.score_clipped += clipped
        kl_coef = self.kl_coef if self.settings.kl_mode == "reward" else 0.0
        rewards = per_token_rewards(scores, batch.old_logprobs, batch.ref_logprobs, mask, kl_coef)
        advantages, returns = gae(rewards, batch.values, mask, self.settings.gamma, self.settings.lam)
        advantages, clipped = sigma_clip(masked_whiten(advantages, mask), n_sigma, mask)
        self.counters.advantage_clipped += clipped
        return advantages, returns

    # ---- update --------------------------------------------------------------------------------------------
    def after_backward(self) -> None:
        """Hook between backward and the optimizer step (fault-injection tests override it)."""

    def minibatch(self, batch: Rollout, rows: torch.Tensor, advantages, returns) -> dict:
        """One guarded optimizer step on ``rows`` of the batch; returns its statistics."""
        s, env = self.settings, self.envelope
        snapshot = Snapshot(self.params, self.optimizer) if env.rollback else None
        self.policy.eval()  # dropout off in every RL forward: the first ratio is exactly 1, not dropout noise
        new, entropy, values = forward_logprobs(self.policy, batch.input_ids[rows], batch.attention_mask[rows],
                                                batch.prompt_width, s.temperature, self.value_head)
        mask = batch.mask[rows]
        ratio = ratio_of(new, batch.old_logprobs[rows], env.log_ratio_clamp)
        stats = {"ratio/mean": float(masked_mean(ratio.detach(), mask)),
                 "ratio/max": float((ratio.detach() * mask).max()),
                 "entropy": float(masked_mean(entropy.detach(), mask))}
        if env.ratio_guard and self.world.mean(stats["ratio/mean"]) > env.ratio_guard:
            self.counters.skipped += 1  # no backward, no optimizer step: parameters and state stay as they are
            return dict(stats, skipped=1)
        loss_type = s.loss_type if self.grpo else "token_mean"
        eps_high = s.clip_eps_high if self.grpo else s.clip_eps
        loss, clip_frac = clipped_policy_loss(ratio, advantages[rows], mask, s.clip_eps, eps_high, loss_type,
                                              s.max_new_tokens)
        stats.update({"loss/policy": float(loss.detach()), "clip_frac": float(clip_frac)})
        if self.grpo and s.beta:
            kl = kl_k3(new, batch.ref_logprobs[rows], env.log_ratio_clamp)
            loss = loss + s.beta * aggregate(kl, mask, loss_type, s.max_new_tokens)
        if not self.grpo:
            value_loss = clipped_value_loss(values, batch.values[rows], returns[rows], mask, s.value_clip)
            loss = loss + s.value_coef * value_loss
            stats["loss/value"] = float(value_loss.detach())
            if s.kl_mode == "loss":
                loss = loss + self.kl_coef * masked_mean(kl_k3(new, batch.ref_logprobs[rows], env.log_ratio_clamp),
                                                         mask)
        self.optimizer.zero_grad(set_to_none=True)
        if env.rollback and self.world.any(not all_finite([loss])):
            return self._roll_back(snapshot, stats, "non-finite loss")
        loss.backward()
        self.after_backward()
        self.world.average_([p.grad for p in self.params])  # data parallel: every replica takes the same step
        if env.rollback and not all_finite([p.grad for p in self.params]):
            return self._roll_back(snapshot, stats, "non-finite gradient")
        max_norm = env.grad_clip if env.grad_clip else float("inf")
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        self.optimizer.step()
        if env.rollback and not all_finite(self.params):
            return self._roll_back(snapshot, stats, "non-finite parameter")
        self.counters.consecutive_rollbacks = 0
        return dict(stats, loss=float(loss.detach()), skipped=0)

    def _roll_back(self, snapshot: Snapshot, stats: dict, reason: str) -> dict:
        snapshot.restore()
        self.counters.rolled_back(self.envelope.max_consecutive_rollbacks, reason)
        return dict(stats, rolled_back=1, skipped=0)

    def update(self, batch: Rollout, advantages, returns, step: int) -> list[dict]:
        size, results = batch.scores.shape[0], []
        for epoch in range(self.settings.epochs):
            generator = torch.Generator().manual_seed(self.seed * 31 + step * 1009 + epoch)
            order = torch.randperm(size, generator=generator)
            for start in range(0, size, self.settings.minibatch_size):
                results.append(self.minibatch(batch, order[start:start + self.settings.minibatch_size],
                                              advantages, returns))
        return results

    # ---- one iteration -------------------------------------------------------------------------------------
    def run_step(self, step: int) -> dict:
        started = time.time()
        batch, zero_std = self.rollout(step)
        self._require_training_tokens(batch, step)
        advantages, returns = self.advantages(batch)
        results = self.update(batch, advantages, returns, step)
        self.step = step + 1
        kl = float(((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum(-1).mean())
        if not self.grpo and self.settings.adaptive_kl:
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl, self.settings.target_kl)
        metrics = _summarise(batch, results, advantages, returns, kl, time.time() - started)
        metrics.update({"step": self.step, "kl_coef": self.kl_coef, "guard/skipped": self.counters.skipped,
                        "guard/rollbacks": self.counters.rollbacks, "guard/score_clipped": self.counters.score_clipped,
                        "guard/advantage_clipped": self.counters.advantage_clipped})
        if self.grpo:
            metrics["grpo/zero_std_frac"] = zero_std / max(1, self.settings.prompts_per_step)
        return metrics

    def _require_training_tokens(self, batch: Rollout, step: int) -> None:
        """Stop when no completion token of the rollout trains (on every rank): an update would only replay AdamW's
        stale momentum on a zero gradient."""
        if not self.world.all(float(batch.mask.sum()) == 0):
            return
        budget = self.settings.max_new_tokens
        raise UserError(f"RL iteration {step + 1}: every completion ran to max_new_tokens={budget} without EOS and "
                        "--mask-truncated gives truncated completions no gradient, so nothing would train; raise "
                        "--max-new-tokens or drop --mask-truncated")

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "kl_coef": self.kl_coef, "counters": asdict(self.counters),
                "params": {n: p.detach().clone() for n, p in self.named_params},
                "optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, param in self.named_params:
                param.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.kl_coef = state["step"], state["kl_coef"]
        self.counters = GuardCounters(**state["counters"])
        torch.set_rng_state(state["torch_rng"])


def _mean(results: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in results if key in r]
    return sum(values) / len(values) if values else None


def _summarise(batch: Rollout, results: list[dict], advantages, returns, kl: float, seconds: float) -> dict:
    lengths = batch.lengths.float()
    metrics = {"reward/mean": float(batch.scores.mean()), "reward/std": float(batch.scores.std()),
               "kl": kl, "completion/length": float(lengths.mean()),
               "completion/truncated_frac": float(batch.truncated.float().mean()),
               "ratio/max": max(r["ratio/max"] for r in results), "step_time": seconds,
               "tokens_per_s": float(lengths.sum()) / seconds if seconds else 0.0}
    for key in ("ratio/mean", "entropy", "clip_frac", "loss/policy", "loss/value", "grad_norm"):
        metrics[key] = _mean(results, key)
    if returns is not None and batch.values is not None:
        mask = batch.mask
        residual = masked_mean((returns - batch.values) ** 2, mask)
        variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        metrics["value/explained_variance"] = float(1 - residual / variance) if variance > 0 else 0.0
    return metrics
