"""``feedback collect``: many devices' stores and export files merged into the next round's rows, consented
and scrubbed, one row per device and turn, each device capped, each row with its provenance; what is not
ours refused in one line while the rest is collected; Parquet and JSONL that ``datasets`` reads; memory
bounded while streaming many stores."""

import json
import shutil
import tracemalloc

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent import scrub
from slm_align.ondevice.agent.feedback_collect import collect_feedback
from slm_align.ondevice.agent.feedback_export import export_preferences
from slm_align.ondevice.agent.store import PreferenceStore
from tests.helpers import run_cli

MODEL_A = "a" * 64
MODEL_B = "b" * 64
ADAPTERS = {"temperature": 0.0, "adapters": [{"file": "adapter-sft-F16.gguf", "sha256": "c" * 64},
                                             {"file": "adapter-dpo-F16.gguf", "sha256": "d" * 64}]}


def prompt(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def fast(store: PreferenceStore) -> PreferenceStore:
    """The store without an fsync per write: these tests make thousands of turns."""
    store._conn.execute("PRAGMA synchronous = OFF")
    return store


def thumbs_store(path, model_id, n, consent=True, sampling=None, text="Story {i}", offset=0):
    """A store of ``n`` turns, each rated (up on even turns), made through the store's API."""
    with fast(PreferenceStore(path)) as store:
        for i in range(offset, offset + n):
            turn = store.record_turn(f"c{i}", prompt(text.format(i=i)), f"Answer {i}.", model_id,
                                     sampling or {"temperature": 0.0}, consent)
            store.thumbs(turn, i % 2 == 0)
    return path


@pytest.fixture
def fleet(tmp_path):
    """phone-1 (the adapter chain answered): a thumbs-up with an e-mail in it, a choice, an edit, a turn
    without consent; phone-2 (the base answered): two thumbs; a text file that is no store."""
    root = tmp_path / "fleet"
    root.mkdir()
    with PreferenceStore(root / "phone-1.db") as store:
        up = store.record_turn("c1", prompt("Who do I write to?"), "Write to ann.lee@example.com today.",
                               MODEL_A, ADAPTERS, True)
        store.thumbs(up, True)
        chosen = store.record_turn("c2", prompt("Name a river."), "The Nile.", MODEL_A, ADAPTERS, True)
        store.choose(chosen, "A river.", "this")
        edited = store.record_turn("c3", prompt("Say hi."), "Bye.", MODEL_A, ADAPTERS, True)
        store.edit(edited, "Hi!")
        private = store.record_turn("c4", prompt("My secret plan?"), "Tell nobody.", MODEL_A, ADAPTERS, False)
        store.thumbs(private, False)
    thumbs_store(root / "phone-2.db", MODEL_B, 2)
    (root / "notes.txt").write_text("not a store\n")
    return root


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_consented_scrubbed_rows_keep_their_provenance_and_a_non_store_is_refused_in_one_line(fleet, tmp_path,
                                                                                                capsys):
    out = tmp_path / "round2"
    inputs = [fleet / "phone-1.db", fleet / "notes.txt", fleet / "phone-2.db"]
    code, stdout, stderr = run_cli(capsys, "feedback", "collect", *inputs, "--out", out)
    assert code == 0 and "3 rated answers from 2 device(s)" in stdout
    refused = [line for line in stderr.splitlines() if "notes.txt" in line]
    assert len(refused) == 1 and "not a preference store" in refused[0]
    assert "1 turn(s) without consent skipped" in stderr
    pairs = read_jsonl(out / "pairs.jsonl")
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("The Nile.", "A river."), ("Hi!", "Bye.")]
    assert {(p["device"], p["model_id"], p["arm"]) for p in pairs} == {
        ("phone-1", MODEL_A, "adapter-sft-F16.gguf+adapter-dpo-F16.gguf")}
    unpaired = read_jsonl(out / "unpaired.jsonl")
    assert [(u["device"], u["model_id"], u["arm"], u["label"]) for u in unpaired] == [
        ("phone-1", MODEL_A, "adapter-sft-F16.gguf+adapter-dpo-F16.gguf", True),
        ("phone-2", MODEL_B, "base", True), ("phone-2", MODEL_B, "base", False)]
    assert unpaired[0]["completion"][0]["content"] == "Write to <EMAIL> today."
    assert "Tell nobody." not in (out / "unpaired.jsonl").read_text()  # no consent, not collected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["per_device"] == {"phone-1": 3, "phone-2": 2}
    assert summary["per_model"] == {MODEL_A: 3, MODEL_B: 2}
    assert summary["rejected"]["without_consent"] == 1 and summary["scrubbed_replacements"] == 1
    assert [item["input"] for item in summary["refused"]] == [str(fleet / "notes.txt")]


def test_an_export_file_is_scrubbed_again_and_counts_as_its_devices_turns(fleet, tmp_path):
    export_preferences(fleet / "phone-1.db", fleet / "phone-1.jsonl", scrub=False)
    assert "ann.lee@example.com" in (fleet / "phone-1.unpaired.jsonl").read_text()
    summary = collect_feedback([fleet / "phone-1.jsonl", fleet / "phone-1.unpaired.jsonl", fleet / "phone-1.db"],
                               tmp_path / "out")
    assert summary["rows"] == {"pairs": 2, "unpaired": 1, "tasks": 1, "demonstrations": 1}
    assert summary["rejected"]["duplicates"] == 3
    [row] = read_jsonl(tmp_path / "out" / "unpaired.jsonl")
    assert row["completion"][0]["content"] == "Write to <EMAIL> today." and row["device"] == "phone-1"
    assert row["arm"] is None  # an export file does not say which adapters answered


def test_copies_of_one_turn_count_once_and_each_device_is_capped(tmp_path):
    with fast(PreferenceStore(tmp_path / "loud.db")) as store:
        for _ in range(10_000):
            store.thumbs(store.record_turn("c", prompt("Same?"), "Same.", MODEL_A, {}, True), True)
    thumbs_store(tmp_path / "big.db", MODEL_A, 50)
    thumbs_store(tmp_path / "small.db", MODEL_B, 5)
    summary = collect_feedback([tmp_path / name for name in ("loud.db", "big.db", "small.db")], tmp_path / "out",
                               max_rows_per_device=20)
    assert summary["per_device"] == {"loud": 1, "big": 20, "small": 5}
    assert summary["rejected"]["duplicates"] == 9_999 and summary["rejected"]["over_cap"] == 30
    assert summary["devices_at_cap"] == ["big"]
    rows = read_jsonl(tmp_path / "out" / "unpaired.jsonl")
    assert [r["prompt"][0]["content"] for r in rows if r["device"] == "big"] == [f"Story {i}" for i in range(20)]
    assert len({r["prompt"][0]["content"] for r in rows if r["device"] == "small"}) == 5  # nothing of the rest lost


def test_the_same_turn_on_two_devices_is_two_rows(tmp_path):
    thumbs_store(tmp_path / "one.db", MODEL_A, 3)
    shutil.copy(tmp_path / "one.db", tmp_path / "two.db")
    summary = collect_feedback([tmp_path / "one.db", tmp_path / "two.db", tmp_path / "one.db"], tmp_path / "out")
    assert summary["per_device"] == {"one": 3, "two": 3} and summary["rejected"]["duplicates"] == 3


def test_parquet_shards_and_jsonl_load_with_datasets(fleet, tmp_path):
    datasets = pytest.importorskip("datasets")
    thumbs_store(fleet / "phone-3.db", MODEL_B, 7, sampling=ADAPTERS)
    out = tmp_path / "round2"
    collect_feedback(sorted(fleet.glob("*.db")), out, shard_rows=3)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["files"]["unpaired"]["parquet"]) == 4  # 10 rated answers, 3 per shard
    for kind in ("pairs", "unpaired"):
        shards = [str(out / name) for name in summary["files"][kind]["parquet"]]
        parquet = datasets.load_dataset("parquet", data_files=shards, split="train", cache_dir=str(tmp_path / "c"))
        jsonl = datasets.load_dataset("json", data_files=str(out / f"{kind}.jsonl"), split="train",
                                      cache_dir=str(tmp_path / "c"))
        assert len(parquet) == len(jsonl) == summary["rows"][kind]
        assert parquet["device"] == jsonl["device"] and parquet["model_id"] == jsonl["model_id"]
        assert [m[0]["content"] for m in parquet["prompt"]] == [m[0]["content"] for m in jsonl["prompt"]]
    assert set(parquet["arm"]) == {"base", "adapter-sft-F16.gguf+adapter-dpo-F16.gguf"}


def test_nothing_to_collect_or_an_occupied_out_is_one_line_and_writes_nothing(fleet, tmp_path, capsys):
    code, out, err = run_cli(capsys, "feedback", "collect", fleet / "notes.txt", "--out", tmp_path / "none")
    assert code == 2 and err.count("\n") == 1 and "no input is feedback" in err
    assert not (tmp_path / "none").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "feedback", "collect", fleet / "phone-2.db", "--out", taken)
    assert code == 2 and "--overwrite" in err and (taken / "keep.txt").read_text() == "mine"
    with pytest.raises(UserError, match="max-rows-per-device"):
        collect_feedback([fleet / "phone-2.db"], tmp_path / "x", max_rows_per_device=0)



def test_a_failed_collection_leaves_the_earlier_round_whole_and_no_scratch(fleet, tmp_path):
    """With --overwrite, a collection that keeps no row publishes nothing: the earlier folder stays as
    it was and no scratch folder is left beside it; one that keeps rows replaces it whole."""
    out = tmp_path / "rounds" / "round2"
    collect_feedback([fleet / "phone-2.db"], out)
    earlier = {path.name: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    with pytest.raises(UserError, match="no input is feedback"):
        collect_feedback([fleet / "notes.txt"], out, overwrite=True)
    assert {path.name: path.read_bytes() for path in out.rglob("*") if path.is_file()} == earlier
    assert [path.name for path in out.parent.iterdir()] == ["round2"]
    summary = collect_feedback([fleet / "phone-1.db"], out, overwrite=True)
    verdicts = summary["rows"]["pairs"] + summary["rows"]["unpaired"]  # task rows ride with them
    assert summary["per_device"] == {"phone-1": verdicts}
    assert json.loads((out / "summary.json").read_text())["per_device"] == summary["per_device"]
    assert [path.name for path in out.parent.iterdir()] == ["round2"]

def peak_collecting(stores, out) -> tuple[int, int]:
    """(peak bytes of Python allocations while collecting ``stores``, bytes of rows written)."""
    tracemalloc.start()
    try:
        collect_feedback(stores, out, max_rows_per_device=1_000, shard_rows=100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, (out / "unpaired.jsonl").stat().st_size


def test_collecting_many_stores_streams_in_bounded_memory(tmp_path, monkeypatch):
    """3 then 15 stores of 200 rated turns: five times the rows, the same peak of Python allocations (the
    rows are streamed, the dedupe index is on disk, a Parquet shard is the most held)."""
    monkeypatch.setattr(scrub, "library_rules", lambda: ((), None))  # the floor only: this measures the collector
    template = thumbs_store(tmp_path / "template.db", MODEL_A, 200, text="Story {i}: the fox went to the river.")
    stores = []
    for device in range(15):
        stores.append(tmp_path / f"device-{device:02d}.db")
        shutil.copy(template, stores[-1])
    collect_feedback(stores[:1], tmp_path / "warm")  # one-off costs (imports, compiled patterns) first
    few, few_bytes = peak_collecting(stores[:3], tmp_path / "few")
    many, many_bytes = peak_collecting(stores, tmp_path / "many")
    assert many_bytes == 5 * few_bytes and many_bytes - few_bytes > 600_000
    assert many < few * 1.3 + 100_000, (few, many)  # 2,400 more rows held would add megabytes


CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Compute.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def test_train_reads_the_parquet_shards_as_the_jsonl_with_the_tools_offered(tmp_path):
    """The next round's rows keep the tools each prompt offered, and DPO/KTO read a shard (tool calls and
    tools as JSON text) as they read the JSONL: the same prompt, the tools shown, the earlier call rendered."""
    pytest.importorskip("pyarrow")
    from slm_align.data.preferences import read_preference_rows
    from slm_align.modeling.models import DEFAULT_MODEL_DIR, load_tokenizer, resolve_source

    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "5"}]
    with PreferenceStore(tmp_path / "phone-1.db") as store:
        store.thumbs(store.record_turn("c1", messages, "It is 5.", MODEL_A, {"tools": [CALCULATOR]}, True), True)
        store.thumbs(store.record_turn("c2", prompt("Hi"), "Hello.", MODEL_A, {"temperature": 0.0}, True), False)
    collect_feedback([tmp_path / "phone-1.db"], tmp_path / "round2")
    rows = [json.loads(line) for line in (tmp_path / "round2" / "unpaired.jsonl").read_text().splitlines()]
    assert [row.get("tools") for row in rows] == [[CALCULATOR], None]
    tokenizer = load_tokenizer(resolve_source(str(DEFAULT_MODEL_DIR)))
    jsonl = read_preference_rows(tmp_path / "round2" / "unpaired.jsonl", tokenizer).labelled
    shard = read_preference_rows(tmp_path / "round2" / "unpaired" / "part-00000.parquet", tokenizer).labelled
    assert shard == jsonl
    assert "calculator(expression" in jsonl[0].prompt and '"expression": "2+3"' in jsonl[0].prompt
    assert "calculator" not in jsonl[1].prompt
