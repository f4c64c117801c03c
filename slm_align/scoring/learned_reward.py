"""The trained Bradley-Terry reward model as a reward function (the protocol of
:mod:`slm_align.ondevice.rewards.protocol`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from slm_align.scoring.reward_model import load_reward_model, score_texts


class LearnedReward:
    """The trained Bradley-Terry model as a reward function (loads alone from ``reward/model``)."""

    def __init__(self, path: Path, max_length: int = 256, batch_size: int = 16,
                 device: str = "cpu"):
        self.model, self.tokenizer = load_reward_model(path)
        self.model.to(device)
        self.max_length = max_length
        self.batch_size = batch_size

    def __call__(self, prompts, completions, truncated: Optional[Sequence[bool]] = None, **_) -> list[float]:
        """Scores of the texts; a completion flagged ``truncated`` (no EOS within the
        budget) is scored as written."""
        return score_texts(self.model, self.tokenizer, list(prompts), list(completions),
                           self.max_length, self.batch_size,
                           None if truncated is None else list(truncated))



def learned_reward(path: Optional[Path], device: str = "cpu") -> Optional[LearnedReward]:
    """The reward model at ``path`` on ``device``, or None when there is none."""
    if path is None:
        return None
    return LearnedReward(Path(path), device=device)
