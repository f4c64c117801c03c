"""Hub datasets: a hub id is read through datasets' cache, an unreachable one is one line, a local
path is not taken for one."""

from pathlib import Path

from tests.helpers import run_cli


def test_an_unreachable_hub_dataset_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "sft", "--data", "nobody-here/no-such-dataset", "--out", out, "--max-steps", "1")
    assert code == 2 and err.count("\n") == 1
    assert "nobody-here/no-such-dataset" in err and "datasets cache or the hub" in err
    assert not out.exists()


def test_a_hub_dataset_in_the_cache_is_read(monkeypatch):
    """A hub id reaches datasets.load_dataset; its train split's rows become the corpus."""
    import datasets

    from slm_align.data import hub
    from slm_align.data.readers import fingerprint, read_examples

    table = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["held out"]}),
                                  "train": datasets.Dataset.from_dict({"text": ["one story.", "two stories."]})})
    asked = []

    def cached(name):
        asked.append(name)
        return table

    hub.load_hub_dataset.cache_clear()
    monkeypatch.setattr(datasets, "load_dataset", cached)
    try:
        examples = read_examples(Path("someone/stories"))
        digest = fingerprint(Path("someone/stories"))
    finally:
        hub.load_hub_dataset.cache_clear()
    assert [example.text for example in examples] == ["one story.", "two stories."]
    assert digest == f"hub:someone/stories:{table['train']._fingerprint}" and asked == ["someone/stories"]


def test_a_missing_local_file_is_not_taken_for_a_hub_id(tmp_path):
    from slm_align.data.hub import is_hub_dataset
    from slm_align.data.readers import SUFFIXES

    assert not is_hub_dataset(tmp_path / "nope.jsonl", SUFFIXES)
    assert not is_hub_dataset(tmp_path / "stories", SUFFIXES)  # an absolute path
    assert is_hub_dataset(Path("roneneldan/TinyStories"), SUFFIXES)
