"""How rewards vary over a policy's samples, and which algorithm can learn from that variation.

GRPO learns only from variation *within* a prompt's group: its advantage is each completion's
reward minus the group mean, so a group whose rewards are all equal contributes nothing (Shao et
al. 2024; DAPO, Yu et al. 2025, resamples such groups). Variation *between* prompts (one prompt
easy, another hard) gives GRPO nothing and PPO only what its value head can separate. The gate
therefore samples k completions per prompt and measures the within-prompt spread; the share of
all-equal prompts decides the advice.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

# Rewards closer than this count as equal (as an all-equal GRPO group:
# slm_align.rl.advantages.ZERO_STD).
EQUAL = 1e-6


@dataclass(frozen=True)
class Spread:
    """Reward variation over ``prompts`` x ``k`` samples (scores grouped by prompt, contiguous)."""

    within: float
    """Mean over prompts of the population std of that prompt's k rewards."""
    between: float
    """Population std, over prompts, of each prompt's mean reward."""
    overall: float
    """Population std of all rewards (the gate's figure before within-prompt sampling)."""
    all_equal_share: float
    """Share of prompts whose k rewards are all equal (GRPO would skip them)."""
    prompts: int
    k: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure_spread(scores: Sequence[float], k: int) -> Spread:
    """Within-prompt, between-prompt and overall spread of ``scores``, ``k``
    contiguous scores per prompt.

    Shapes: ``scores`` has ``P * k`` entries; ``groups[p] = scores[p*k:(p+1)*k]``. within = mean_p
    std(groups[p]); between = std_p mean(groups[p]); std is the population std (ddof 0).
    """
    if k < 1 or len(scores) % k or not scores:
        raise ValueError(f"{len(scores)} scores do not split into groups of {k}")
    groups = [list(scores[start:start + k]) for start in range(0, len(scores), k)]
    stds = [statistics.pstdev(group) for group in groups]
    means = [statistics.fmean(group) for group in groups]
    equal = [max(group) - min(group) <= EQUAL for group in groups]
    return Spread(within=statistics.fmean(stds),
                  between=statistics.pstdev(means) if len(means) > 1 else 0.0,
                  overall=statistics.pstdev(scores), all_equal_share=sum(equal) / len(groups),
                  prompts=len(groups), k=k)


def projected_share(share: float, k: int, group_size: int) -> float:
    """The all-equal share expected in groups of ``group_size`` from ``share``
    measured with ``k`` samples.

    A group of G samples is all-equal only if each of its G/k blocks of k is (and the blocks agree,
    which only lowers it): share_G <= share^(G/k). Used as the estimate.
    """
    return share ** (group_size / k)


def group_size_for(share: float, k: int, target: float) -> int:
    """The smallest group size G with ``projected_share(share, k, G) <= target`` (0:
    none, the share is 1)."""
    if share <= target:
        return k
    if share >= 1.0:
        return 0
    return math.ceil(k * math.log(target) / math.log(share))


def recommend(spread: Spread, max_all_equal_share: float, group_size: int) -> dict:
    """``{"algo": "grpo" | "ppo", "why": one line}``: GRPO while its groups of ``group_size`` are
    expected to be all-equal at most ``max_all_equal_share`` of the time, else PPO."""
    share = spread.all_equal_share
    projected = projected_share(share, spread.k, group_size)
    measured = f"{share:.0%} of prompts got identical rewards in {spread.k} samples"
    if projected <= max_all_equal_share:
        why = (f"GRPO: {measured} (about {projected:.0%} expected in groups of {group_size}); mean "
               f"within-prompt std {spread.within:.3g}, so its group baseline has signal "
               "and needs no value head")
        return {"algo": "grpo", "why": why}
    needed = group_size_for(share, spread.k, max_all_equal_share)
    larger = "no group size would help: the reward never varied within a prompt"
    if needed:
        larger = f"or raise --group-size to {needed} (now {group_size})"
    why = (f"PPO: {measured}; GRPO would learn nothing from them, PPO's learned value baseline "
           f"still does; {larger}")
    return {"algo": "ppo", "why": why}


SOLVED = 0.9
"""A flat spread whose mean reward lies at least this far up the reward's range (0 its worst, 1 its
best) is read as "the samples succeed"; at most ``1 - SOLVED`` up, as "they fail"."""

CASE_REMEDIES = {
    "solved": ("SFT already solves the task, so RL has nothing left to learn: evaluate the SFT "
               "policy (evaluate, or export and evaluate-agent), or train RL on harder tasks or "
               "from fewer SFT steps"),
    "unreached": ("the prior cannot reach the reward, so RL never sees a success to follow: train "
                  "SFT longer or on more or better demonstrations, or start from a larger base "
                  "model"),
    "flat": ("the reward barely varies over the policy's samples, so RL has nothing to follow: use "
             "a more discriminative reward (another reward model, a graded --reward, or more "
             "samples per prompt)"),
}
"""What to do in each case of a flat within-prompt spread (:func:`flat_case`)."""


@dataclass(frozen=True)
class FlatCase:
    """Why the rewards of a prompt's samples do not vary: ``case`` is ``"solved"`` (nearly every
    sample earns the reward's best), ``"unreached"`` (its worst) or ``"flat"`` (in between, or on a
    reward whose range is unknown)."""

    case: str
    position: Optional[float]
    """Mean reward as a share of the reward's range (0 worst, 1 best); None when the range is
    unknown."""
    seen: str
    """What the gate saw, in words."""

    @property
    def remedy(self) -> str:
        return f"{self.seen}: {CASE_REMEDIES[self.case]}"

    def to_dict(self) -> dict:
        return dict(asdict(self), remedy=self.remedy)


def flat_case(scores: Sequence[float], bounds: Optional[tuple[float, float]]) -> FlatCase:
    """Which case a flat spread is: where the mean of ``scores`` lies in ``bounds`` (the reward's
    worst and best score, None when unknown, as for a learned reward model).

    position = (mean(scores) - low) / (high - low); "solved" when position >= :data:`SOLVED`,
    "unreached" when position <= 1 - :data:`SOLVED`, else "flat". Without bounds the observed
    scores cannot say whether a sample succeeded, so the case is "flat".
    """
    mean = statistics.fmean(scores)
    if bounds is None or bounds[1] - bounds[0] <= EQUAL:
        return FlatCase("flat", None,
                        f"mixed but flat (mean reward {mean:.3g} over {len(scores)} samples; "
                                      "the reward's range is unknown)")
    low, high = bounds
    position = (mean - low) / (high - low)
    at_best = sum(1 for score in scores if score >= high - EQUAL)
    seen = f"{at_best}/{len(scores)} samples at the reward's best {high:g}, mean {mean:.3g}, worst {low:g}"
    if position >= SOLVED:
        return FlatCase("solved", position, f"all samples succeed ({seen})")
    if position <= 1 - SOLVED:
        return FlatCase("unreached", position, f"all samples fail ({seen})")
    return FlatCase("flat", position, f"mixed but flat ({seen})")
