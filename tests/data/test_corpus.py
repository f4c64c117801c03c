import csv
import json

import pytest

from slm_align.config import DataSettings
from slm_align.data.corpus import load_corpus
from slm_align.data.examples import Example
from slm_align.data.readers import read_examples
from slm_align.data.splits import split_examples
from slm_align.errors import UserError

ROWS = [{"text": f"Story number {i}. It was a good day."} for i in range(12)]


def test_txt_blocks_are_documents(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("first line\nstill first\n\n\nsecond doc\n\nthird doc\n", encoding="utf-8")
    assert [e.text for e in read_examples(path)] == ["first line still first",
                                                     "second doc", "third doc"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", "dataset-dir"])
def test_every_format_reads_the_same_documents(tmp_path, suffix):
    path = tmp_path / f"c{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS), encoding="utf-8")
    elif suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["text"])
            writer.writeheader()
            writer.writerows(ROWS)
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets

        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    assert [e.text for e in read_examples(path)] == [r["text"] for r in ROWS]


def test_text_column_found_or_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": 1, "story": "A story."}\n{"id": 2, "story": "Another."}\n',
                    encoding="utf-8")
    assert [e.text for e in read_examples(path)] == ["A story.", "Another."]
    path.write_text('{"body2": "x", "note": "y"}\n', encoding="utf-8")
    assert [e.text for e in read_examples(path, text_field="note")] == ["y"]


def test_prompt_completion_and_messages_rows(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [{"prompt": "Q: 2+2?", "completion": " 4"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    first, second = read_examples(path)
    assert (first.prompt, first.completion) == ("Q: 2+2?", " 4")
    assert second.messages == ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})


@pytest.mark.parametrize("content, expected", [
    ("", "holds no documents"),
    ('{"text": "ok"}\n{"text": broken}\n', ":2: not valid JSON"),
    ('{"title": "no text here"}\n', ":1: no text column (found: title)"),
    ('{"text": 5}\n', "holds int, expected text"),
    ('{"messages": "hi"}\n', "'messages' must be a non-empty list"),
])
def test_bad_rows_name_file_and_line(tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")) as err:
        read_examples(path)
    assert str(path) in str(err.value)


def test_wrong_encoding_and_unknown_suffix(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        read_examples(latin)
    odd = tmp_path / "c.xml"
    odd.write_text("<a/>")
    with pytest.raises(UserError, match="unsupported format .xml"):
        read_examples(odd)


def test_split_is_deterministic_and_disjoint():
    examples = [Example(text=f"document {i}") for i in range(200)]
    a = split_examples(examples, seed=7, eval_fraction=0.1, heldout_prompts=50)
    b = split_examples(list(reversed(examples)), seed=7, eval_fraction=0.1, heldout_prompts=50)
    assert a == b  # order of the input does not matter, only the seed
    c = split_examples(examples, seed=8, eval_fraction=0.1, heldout_prompts=50)
    assert a.heldout != c.heldout
    assert (len(a.heldout), len(a.eval), len(a.train)) == (20, 20, 160)


def test_no_heldout_or_eval_item_appears_in_training_data_even_with_duplicates():
    base = [Example(text=f"doc {i} once upon a time") for i in range(100)]
    noisy = base + base[:30] + [Example(text="doc 3   once upon a   time")]  # exact and whitespace duplicates
    splits = split_examples(noisy, seed=0, eval_fraction=0.2, heldout_prompts=200)
    train_keys = {e.key() for e in splits.train}
    assert not train_keys & {e.key() for e in splits.heldout}
    assert not train_keys & {e.key() for e in splits.eval}
    assert splits.duplicates_dropped == 31
    assert len(splits.train) + len(splits.eval) + len(splits.heldout) == 100


def test_too_small_corpus_is_a_user_error(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("one\n\ntwo\n\nthree\n", encoding="utf-8")
    with pytest.raises(UserError, match="3 distinct documents"):
        load_corpus(DataSettings(path=str(path)), seed=0)


def test_demo_corpus_is_reproducible():
    a = load_corpus(DataSettings(demo_documents=100), seed=0)
    b = load_corpus(DataSettings(demo_documents=100), seed=0)
    assert a == b and a.fingerprint == "demo:100:0"
