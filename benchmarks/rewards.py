"""Reward functions the benchmarks pass as ``--reward rewards:NAME`` (TRL's ``fn(prompts,
completions, **cols)``)."""

from __future__ import annotations


def brevity(prompts, completions, target_words: int = 30, **_) -> list[float]:
    """1 for an empty answer, falling linearly to 0 at ``target_words`` words: a reward every
    policy can climb (end sooner) whose samples differ within a prompt's group, so GRPO has
    something to learn from."""
    return [max(0.0, 1.0 - len(completion.split()) / target_words) for completion in completions]
