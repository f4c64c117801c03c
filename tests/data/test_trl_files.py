"""Preference files as TRL's own code writes them (trl.data_utils, the dev extra installs TRL), read by our
readers: TRL's unpaired (KTO) conversion of pairs, and conversational pairs with an implicit prompt, rendered as
TRL's DPO trainer renders them."""

import datasets
import pytest

from slm_align.data.preferences import read_preference_rows
from slm_align.modeling.models import DEFAULT_MODEL_DIR, load_tokenizer, resolve_source

trl_data = pytest.importorskip("trl.data_utils")  # the dev extra installs trl: under CI=true a skip fails

PAIRS = {"prompt": ["Tell me about a cat.", "Say hello."],
         "chosen": [" The cat slept in the sun.", " Hello!"],
         "rejected": [" Cat cat cat.", " Go away."]}


def test_trls_unpaired_conversion_reads_as_the_same_verdicts(tmp_path):
    path = tmp_path / "kto.jsonl"
    trl_data.unpair_preference_dataset(datasets.Dataset.from_dict(PAIRS)).to_json(str(path))
    rows = read_preference_rows(path)
    read = sorted((item.prompt, item.completion, item.label) for item in rows.labelled)
    expected = sorted([(p, c, True) for p, c in zip(PAIRS["prompt"], PAIRS["chosen"])]
                      + [(p, r, False) for p, r in zip(PAIRS["prompt"], PAIRS["rejected"])])
    assert read == expected and rows.pairs == []
    paired = {(pair.prompt, pair.chosen, pair.rejected) for pair in rows.paired()}  # regrouped by prompt
    assert paired == set(zip(PAIRS["prompt"], PAIRS["chosen"], PAIRS["rejected"]))


def test_conversational_pairs_with_an_implicit_prompt_render_as_trls_dpo_trainer_renders_them(tmp_path):
    tokenizer = load_tokenizer(resolve_source(str(DEFAULT_MODEL_DIR)))
    history = [{"role": "user", "content": "Tell me about a cat."}, {"role": "assistant", "content": "Which cat?"},
               {"role": "user", "content": "Any cat."}]
    implicit = datasets.Dataset.from_dict({
        "chosen": [history + [{"role": "assistant", "content": "The cat slept in the sun."}]],
        "rejected": [history + [{"role": "assistant", "content": "Cat cat cat."}]]})
    path = tmp_path / "implicit.jsonl"
    implicit.to_json(str(path))
    explicit = tmp_path / "explicit.jsonl"
    extracted = implicit.map(trl_data.extract_prompt)  # what TRL does before training: prompt split off
    extracted.to_json(str(explicit))
    rendered = trl_data.apply_chat_template(extracted[0], tokenizer)  # TRL's text for the DPO trainer
    for source in (path, explicit):
        (pair,) = read_preference_rows(source, tokenizer).pairs
        assert (pair.prompt, pair.chosen, pair.rejected) == (rendered["prompt"], rendered["chosen"],
                                                              rendered["rejected"]), source.name
