"""Settings sections (config/base.py): strictness, bounds, the device name, demo data, preference files."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slm_align.config.base import (
    ComputeSettings,
    DataSettings,
    LoraSettings,
    PreferenceSettings,
    RewardSettings,
    SFTSettings,
)


@pytest.mark.parametrize("device", ["auto", "cpu", "mps", "cuda", "cuda:0", "cuda:12"])
def test_known_devices_pass(device):
    """Mutation: the device pattern too narrow (cuda:N refused)."""
    assert ComputeSettings(device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "cpu ", "tpu"])
def test_unknown_devices_are_refused_with_the_choices(device):
    """Mutation: fullmatch loosened to match/search (e.g. 'cpu ' accepted)."""
    with pytest.raises(ValidationError, match="choose auto, cpu, cuda, cuda:N or mps"):
        ComputeSettings(device=device)


def test_sections_refuse_unknown_keys_and_bad_assignments():
    """extra=forbid and validate_assignment (mutation: a typo silently ignored, a bad value set later)."""
    with pytest.raises(ValidationError):
        LoraSettings(rank=8)
    lora = LoraSettings()
    with pytest.raises(ValidationError):
        lora.r = 0
    assert lora.r == 16


@pytest.mark.parametrize("path, demo", [(None, True), ("demo", True), ("./demo", False), ("corpus.txt", False)])
def test_uses_demo(path, demo):
    """Unset or 'demo' is the demo stories; './demo' is a file (mutation: prefix or endswith match)."""
    assert DataSettings(path=path).uses_demo is demo


@pytest.mark.parametrize("field, value", [("eval_fraction", 0.0), ("eval_fraction", 0.5), ("max_length", 4),
                                          ("demo_documents", 9)])
def test_data_bounds(field, value):
    """Open and closed bounds as stated (mutation: gt/lt swapped for ge/le)."""
    with pytest.raises(ValidationError):
        DataSettings(**{field: value})


@pytest.mark.parametrize("given, files", [(None, []), ("a.jsonl", ["a.jsonl"]), (["a", "b"], ["a", "b"])])
def test_reward_preferences_one_or_many(given, files):
    """A single path becomes a list, None an empty one (mutation: a string split into characters)."""
    assert RewardSettings(preferences=given).preferences == files


def test_stage_defaults_differ_where_documented():
    """The reward model's own learning rate; SFT inherits the Trainer settings and adds NEFTune; the
    preference adapter has no dropout (mutation: a subclass default lost)."""
    assert RewardSettings().learning_rate == 1e-3
    assert SFTSettings().learning_rate == 2e-3 and SFTSettings().neftune_alpha == 5.0
    assert PreferenceSettings().lora.dropout == 0.0 and LoraSettings().dropout == 0.05


def test_threads_must_be_positive():
    """Mutation: ge=1 dropped (0 threads accepted)."""
    with pytest.raises(ValidationError):
        ComputeSettings(threads=0)
    assert ComputeSettings(threads=None).threads is None
