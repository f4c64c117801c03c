import random

import pytest

from slm_align.config import DataSettings, PairSettings
from slm_align.data.corpus import load_corpus
from slm_align.data.examples import Example
from slm_align.data.pairs import drop_words, shuffle, synthetic_pairs, truncate
from slm_align.errors import UserError

STORY = ("Once upon a time, there was a cat named Tom. He lived in a small house. One day, Tom "
         "found a red ball. Tom was very happy and smiled. He played with it all day. In the end, "
         "Tom learned that sharing is good.")
OTHER = ("Once upon a time, there was a dog named Mia. She lived in a big forest. One day, Mia "
         "found a blue kite. Mia was very excited. She took it home. In the end, Mia "
         "learned to be patient.")


def test_pairs_come_only_from_training_items():
    corpus = load_corpus(DataSettings(demo_documents=300), seed=0)
    pairs, stats = synthetic_pairs(corpus.splits.train, PairSettings(), seed=0)
    train_texts = {e.text for e in corpus.splits.train}
    held_texts = [e.text for e in corpus.splits.eval + corpus.splits.heldout]
    assert len(pairs) == sum(stats.made.values()) > 200
    for pair in pairs:
        assert pair.prompt + pair.chosen in train_texts  # prompt + chosen is a training document, whole
        assert all(pair.prompt + pair.chosen != text for text in held_texts)
        if pair.kind == "mismatch":
            assert any(text.endswith(pair.rejected) for text in train_texts)  # borrowed from another training item


def test_each_corruption_makes_a_different_rejected_text():
    rejected = {}
    for kind in ("truncate", "shuffle", "mismatch", "dropout"):
        pairs, _ = synthetic_pairs([Example(text=STORY), Example(text=OTHER)], PairSettings(mix={kind: 1.0}), seed=1)
        assert {p.kind for p in pairs} == {kind}
        rejected[kind] = pairs[0].rejected
        assert (pairs[0].rejected != pairs[0].chosen
                and pairs[0].prompt == STORY.split(" He lived")[0] + " He lived in a small house.")
    assert len(set(rejected.values())) == 4
    chosen_words = STORY.split(". ", 2)[2].split()
    assert sorted(rejected["shuffle"].split()) == sorted(chosen_words)  # same words, other order
    assert len(rejected["truncate"].split()) < len(chosen_words) and not rejected["truncate"].endswith(".")
    assert set(rejected["dropout"].split()) <= set(chosen_words)
    assert rejected["mismatch"].strip().startswith("One day, Mia")


def test_corruptions_are_seeded():
    chosen = " " + STORY.split(". ", 2)[2]
    for fn in (truncate, shuffle):
        assert fn(chosen, random.Random(5)) == fn(chosen, random.Random(5))
    assert drop_words(chosen, random.Random(5), 0.3) == drop_words(chosen, random.Random(5), 0.3)


def test_degenerate_pairs_are_dropped_and_counted():
    docs = [Example(text="Hi. Bye. Go. Up."), Example(text="One sentence only."), Example(text=STORY)]
    pairs, stats = synthetic_pairs(docs, PairSettings(mix={"shuffle": 1.0}, min_words=3), seed=0)
    assert len(pairs) == 1
    assert stats.dropped == {"too short": 1, "no prompt and continuation": 1}
    one_sentence_tail = [Example(text="A b c. D e f. G h i j k.")]
    _, stats = synthetic_pairs(one_sentence_tail, PairSettings(mix={"shuffle": 1.0}, min_words=1), seed=0)
    assert stats.dropped == {"chosen equals rejected": 1}


def test_bad_mix_is_a_user_error():
    with pytest.raises(UserError, match="pair mix"):
        synthetic_pairs([Example(text=STORY)], PairSettings(mix={"reverse": 1.0}), seed=0)
    with pytest.raises(UserError, match="pair mix"):
        synthetic_pairs([Example(text=STORY)], PairSettings(mix={"shuffle": 0.0}), seed=0)


def test_pairs_use_trl_columns():
    pairs, _ = synthetic_pairs([Example(text=STORY), Example(text=OTHER)], PairSettings(), seed=0)
    assert set(pairs[0].to_row()) == {"prompt", "chosen", "rejected", "kind"}
