"""What each preference algorithm says of itself, read by the stage and the pipeline instead of
``algo ==`` checks: what it trains on, how the gate counts it, its own figures."""

import pytest

from slm_align.config import PreferenceSettings
from slm_align.data.pairs import Pair
from slm_align.data.preferences import Labelled
from slm_align.errors import UserError
from slm_align.preference.algorithms import ALGORITHMS, preference_algorithm, trains_on_preferences
from slm_align.preference.data import PreferenceData
from slm_align.preference.dpo import DPO
from slm_align.preference.kto import KTO


def data(labels: list[bool]) -> PreferenceData:
    pairs = [Pair(prompt="p", chosen=" yes", rejected=" no")]
    labelled = [Labelled(prompt="p", completion=f" {i}", label=label) for i, label in enumerate(labels)]
    return PreferenceData(train_pairs=pairs, train_labelled=labelled, heldout_pairs=[],
                          heldout_labelled=[], model_ids=set(), prompts=1)


def bare(algorithm, desirable_weight=None):
    """The learner without a model: only what it says of itself."""
    learner = object.__new__(algorithm)
    learner.desirable_weight = desirable_weight
    return learner


def test_the_registry_names_dpo_and_kto_and_refuses_rl_names():
    assert ALGORITHMS == {"dpo": DPO, "kto": KTO}
    assert [trains_on_preferences(name) for name in ("dpo", "kto", "ppo", "grpo", "auto")] == [
        True, True, False, False, False]
    assert preference_algorithm("kto") is KTO
    with pytest.raises(UserError, match="choose one of dpo, kto"):
        preference_algorithm("grpo")


def test_each_algorithm_names_what_it_trains_on():
    assert (DPO.unit, KTO.unit) == ("pairs", "labelled completions")


def test_only_kto_adds_a_label_balance_figure_to_the_gate():
    settings = PreferenceSettings()
    assert bare(DPO).balance_figures(data([True, True, True, False]), settings) == []
    (figure,) = bare(KTO).balance_figures(data([True, True, True, False]), settings)
    assert figure.value == 0.25 and figure.threshold == settings.min_label_share


def test_the_manifest_keeps_the_desirable_weight_key_with_kto_s_value_only():
    assert bare(DPO, desirable_weight=1.0).own_figures() == {"desirable_weight": None}
    assert bare(KTO, desirable_weight=1.5).own_figures() == {"desirable_weight": 1.5}
