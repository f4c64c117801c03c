"""The device wing's row readers: task and corpus files with where each row came from, a hub id read
through datasets' cache (an unreachable one is one line, a local path is not taken for one), and
the runtime reading a task file without loading the training side."""

import subprocess
import sys
from pathlib import Path

from slm_align.ondevice.rows import iter_rows
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

    from slm_align.data.readers import fingerprint, read_examples
    from slm_align.ondevice import rows

    table = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["held out"]}),
                                  "train": datasets.Dataset.from_dict({"text": ["one story.", "two stories."]})})
    asked = []

    def cached(name):
        asked.append(name)
        return table

    rows.load_hub_dataset.cache_clear()
    monkeypatch.setattr(datasets, "load_dataset", cached)
    try:
        examples = read_examples(Path("someone/stories"))
        digest = fingerprint(Path("someone/stories"))
    finally:
        rows.load_hub_dataset.cache_clear()
    assert [example.text for example in examples] == ["one story.", "two stories."]
    assert digest == f"hub:someone/stories:{table['train']._fingerprint}" and asked == ["someone/stories"]


def test_a_missing_local_file_is_not_taken_for_a_hub_id(tmp_path):
    from slm_align.ondevice.rows import SUFFIXES, is_hub_dataset

    assert not is_hub_dataset(tmp_path / "nope.jsonl", SUFFIXES)
    assert not is_hub_dataset(tmp_path / "stories", SUFFIXES)  # an absolute path
    assert is_hub_dataset(Path("roneneldan/TinyStories"), SUFFIXES)


def test_rows_of_each_format_say_where_they_came_from(tmp_path):
    rows = ['{"prompt": "2+2?", "answer": "4"}', "", '{"prompt": "3+3?", "answer": "6"}', ""]
    (tmp_path / "tasks.jsonl").write_text("\n".join(rows))
    (tmp_path / "tasks.csv").write_text("prompt,answer\n2+2?,4\n")
    (tmp_path / "notes.txt").write_text("one line\nstill one\n\nsecond block\n")
    jsonl = list(iter_rows(tmp_path / "tasks.jsonl"))
    assert [where for where, _ in jsonl] == [f"{tmp_path}/tasks.jsonl:1", f"{tmp_path}/tasks.jsonl:3"]
    assert jsonl[1][1] == {"prompt": "3+3?", "answer": "6"}
    csv_rows = list(iter_rows(tmp_path / "tasks.csv"))
    assert csv_rows == [(f"{tmp_path}/tasks.csv:2", {"prompt": "2+2?", "answer": "4"})]
    texts = [row["text"] for _, row in iter_rows(tmp_path / "notes.txt")]
    assert texts == ["one line still one", "second block"]


def test_the_runtime_reads_task_files_without_the_training_side():
    """evaluate-agent's task loader imports the wing's reader at the top: a fresh interpreter that
    imports it loads neither torch nor slm_align's data or modeling packages."""
    probe = ("import sys, slm_align.ondevice.agent.task_eval as t; "
             "assert t.iter_rows.__module__ == 'slm_align.ondevice.rows'; "
             "print(sorted(m for m in ('torch', 'transformers', 'slm_align.data', 'slm_align.modeling') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
