"""``feedback collect``'s task rows and demonstrations: each thumbs-rated turn as a task with its
outcome (the prompt up to the reply, the reply's calls and the tools' results, the tools offered,
the provenance), the rated-up ones as SFT chats that ``slm-align sft`` reads; the consent, dedupe
and caps of their verdicts apply to them; Parquet that ``datasets`` reads."""

import json
import shutil
import sqlite3

import pytest

from slm_align.data.readers import iter_rows, row_to_example
from slm_align.errors import UserError
from slm_align.ondevice.agent.feedback_collect import collect_feedback
from slm_align.ondevice.agent.feedback_export import export_preferences
from slm_align.ondevice.agent.feedback_tasks import balanced
from slm_align.ondevice.agent.store import PreferenceStore
from tests.helpers import old_store
from tests.ondevice.agent.test_feedback_collect import ADAPTERS, MODEL_A, MODEL_B, fast, read_jsonl

ALARM = {
    "type": "function",
    "function": {
        "name": "alarm_set",
        "description": "Set an alarm.",
        "parameters": {
            "type": "object",
            "properties": {"time": {"type": "string"}},
            "required": ["time"],
        },
    },
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
HISTORY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
CALL_TEXT = '<tool_call>{"name": "alarm_set", "arguments": {"time": "06:30"}}</tool_call>'
ROUND = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "2+3"}},
            }
        ],
    },
    {"role": "tool", "name": "calculator", "content": "5"},
]


def sampling(*tools) -> dict:
    return dict(ADAPTERS, tools=list(tools))


@pytest.fixture
def phone(tmp_path):
    """phone-1 (the adapter chain answered): a function call rated up after some history, a
    calculator turn with a tool round rated down, a plain answer rated up, a choice (no outcome of
    its own), an unconsented turn rated up; phone-2 (the base): a call rated down."""
    root = tmp_path / "fleet"
    root.mkdir()
    with PreferenceStore(root / "phone-1.db") as store:
        wake = [*HISTORY, {"role": "user", "content": "Wake me at 6:30."}]
        store.thumbs(store.record_turn("c1", wake, CALL_TEXT, MODEL_A, sampling(ALARM), True), True)
        sum_ = [{"role": "user", "content": "What is 2+3?"}, *ROUND]
        store.thumbs(
            store.record_turn("c2", sum_, "It is 6.", MODEL_A, sampling(CALCULATOR), True), False
        )
        plain = [{"role": "user", "content": "Mail ann.lee@example.com?"}]
        store.thumbs(
            store.record_turn("c3", plain, "I cannot send mail.", MODEL_A, sampling(ALARM), True),
            True,
        )
        store.choose(
            store.record_turn("c4", plain, "No.", MODEL_A, ADAPTERS, True), "Sorry, no.", "other"
        )
        secret = [{"role": "user", "content": "My secret?"}]
        store.thumbs(
            store.record_turn("c5", secret, CALL_TEXT, MODEL_A, sampling(ALARM), False), True
        )
    with PreferenceStore(root / "phone-2.db") as store:
        late = [{"role": "user", "content": "Wake me at 7."}]
        store.thumbs(
            store.record_turn("c1", late, CALL_TEXT, MODEL_B, {"tools": [ALARM]}, True), False
        )
    return root


def test_each_rated_turn_is_a_task_row_with_its_outcome_calls_results_and_provenance(
    phone, tmp_path
):
    summary = collect_feedback([phone / "phone-1.db", phone / "phone-2.db"], tmp_path / "out")
    assert summary["rows"] == {"pairs": 1, "unpaired": 4, "tasks": 4, "demonstrations": 2}
    assert summary["outcomes"] == {"up": 2, "down": 2, "up_with_calls": 1}
    wake, total, plain, late = read_jsonl(tmp_path / "out" / "tasks.jsonl")
    arm = "adapter-sft-F16.gguf+adapter-dpo-F16.gguf"
    assert [
        (t["device"], t["model_id"], t["arm"], t["outcome"]) for t in (wake, total, plain, late)
    ] == [
        ("phone-1", MODEL_A, arm, 1),
        ("phone-1", MODEL_A, arm, 0),
        ("phone-1", MODEL_A, arm, 1),
        ("phone-2", MODEL_B, "base", 0),
    ]
    assert wake["prompt"] == [
        *HISTORY,
        {"role": "user", "content": "Wake me at 6:30."},
    ]  # up to the reply
    call = {"type": "function", "function": {"name": "alarm_set", "arguments": {"time": "06:30"}}}
    assert wake["completion"] == [{"role": "assistant", "content": "", "tool_calls": [call]}]
    assert wake["calls"] == [{"name": "alarm_set", "arguments": {"time": "06:30"}}]
    assert wake["results"] == [] and wake["tools"] == [ALARM]
    assert total["prompt"] == [
        {"role": "user", "content": "What is 2+3?"}
    ]  # the round is the reply's
    assert total["completion"] == [*ROUND, {"role": "assistant", "content": "It is 6."}]
    assert total["calls"] == [{"name": "calculator", "arguments": {"expression": "2+3"}}]
    assert total["results"] == [{"name": "calculator", "content": "5"}]
    assert plain["prompt"][0]["content"] == "Mail <EMAIL>?"  # scrubbed as the other rows are
    assert plain["calls"] == [] and plain["completion"] == [
        {"role": "assistant", "content": "I cannot send mail."}
    ]
    assert "My secret?" not in (tmp_path / "out" / "tasks.jsonl").read_text()  # no consent, no task


def test_the_turns_rated_up_are_sft_chats_that_sft_reads(phone, tmp_path):
    collect_feedback([phone / "phone-1.db", phone / "phone-2.db"], tmp_path / "out")
    path = tmp_path / "out" / "demonstrations.jsonl"
    wake, plain = read_jsonl(path)
    assert wake["messages"][-2:] == [
        {"role": "user", "content": "Wake me at 6:30."},
        read_jsonl(tmp_path / "out" / "tasks.jsonl")[0]["completion"][0],
    ]
    assert (wake["calls"], plain["calls"]) == (1, 0) and wake["device"] == "phone-1"
    examples = [row_to_example(where, row) for where, row in iter_rows(path)]
    assert [len(example.messages) for example in examples] == [4, 2]
    assert examples[0].tools == (ALARM,) and examples[0].messages[-1]["tool_calls"][0][
        "function"
    ] == {"name": "alarm_set", "arguments": {"time": "06:30"}}


def test_copies_and_caps_drop_task_rows_with_their_verdicts(tmp_path):
    with fast(PreferenceStore(tmp_path / "loud.db")) as store:
        for _ in range(500):
            turn = store.record_turn(
                "c",
                [{"role": "user", "content": "Same?"}],
                CALL_TEXT,
                MODEL_A,
                {"tools": [ALARM]},
                True,
            )
            store.thumbs(turn, True)
    with fast(PreferenceStore(tmp_path / "big.db")) as store:
        for i in range(30):
            turn = store.record_turn(
                f"c{i}",
                [{"role": "user", "content": f"Wake me at {i}."}],
                CALL_TEXT,
                MODEL_B,
                {"tools": [ALARM]},
                True,
            )
            store.thumbs(turn, i % 3 == 0)
    shutil.copy(
        tmp_path / "big.db", tmp_path / "big.again.db"
    )  # the same device sends its store twice
    inputs = [tmp_path / name for name in ("loud.db", "big.db", "big.again.db")]
    summary = collect_feedback(inputs, tmp_path / "out", max_rows_per_device=12)
    assert summary["rows"] == {"pairs": 0, "unpaired": 13, "tasks": 13, "demonstrations": 5}
    tasks = read_jsonl(tmp_path / "out" / "tasks.jsonl")
    assert [t["device"] for t in tasks] == ["loud"] + ["big"] * 12
    assert [t["prompt"][0]["content"] for t in tasks[1:]] == [f"Wake me at {i}." for i in range(12)]
    assert [t["outcome"] for t in tasks[1:]] == [int(i % 3 == 0) for i in range(12)]
    assert summary["rejected"]["duplicates"] == 499 + 30 and summary["rejected"]["over_cap"] == 18


def test_an_export_file_gives_the_same_task_rows_and_counts_once_beside_its_store(phone, tmp_path):
    export_preferences(phone / "phone-2.db", phone / "phone-2.jsonl")
    alone = collect_feedback([phone / "phone-2.unpaired.jsonl"], tmp_path / "alone")
    both = collect_feedback(
        [phone / "phone-2.db", phone / "phone-2.unpaired.jsonl"], tmp_path / "both"
    )
    assert (
        alone["rows"]["tasks"] == both["rows"]["tasks"] == 1 and both["rejected"]["duplicates"] == 1
    )
    [from_export] = read_jsonl(tmp_path / "alone" / "tasks.jsonl")
    [from_store] = read_jsonl(tmp_path / "both" / "tasks.jsonl")
    assert from_export == dict(
        from_store, arm=None
    )  # an export file does not say which adapters answered


def test_task_shards_load_with_datasets_as_the_jsonl(phone, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "out"
    summary = collect_feedback([phone / "phone-1.db", phone / "phone-2.db"], out, shard_rows=3)
    shards = [str(out / name) for name in summary["files"]["tasks"]["parquet"]]
    assert len(shards) == 2 and summary["files"]["demonstrations"]["parquet"] == []
    table = datasets.load_dataset(
        "parquet", data_files=shards, split="train", cache_dir=str(tmp_path / "c")
    )
    rows = read_jsonl(out / "tasks.jsonl")
    assert table["outcome"] == [row["outcome"] for row in rows]
    assert [json.loads(calls) if calls else [] for calls in table["calls"]] == [
        row["calls"] for row in rows
    ]
    assert table["results"][1] == [{"name": "calculator", "content": "5"}]
    assert (
        json.loads(table["completion"][0][0]["tool_calls"])
        == rows[0]["completion"][0]["tool_calls"]
    )


def test_balanced_demonstrations_keep_no_more_refusals_than_calls():
    chats = [{"calls": calls, "n": n} for n, calls in enumerate([0, 0, 1, 0, 2, 0])]
    assert [chat["n"] for chat in balanced(chats)] == [2, 4, 0, 1]
    assert [chat["n"] for chat in balanced(chats, "all")] == [0, 1, 2, 3, 4, 5]
    assert balanced([{"calls": 0}] * 3) == []  # no call rated up: no demonstration teaches silence
    with pytest.raises(UserError, match="refusals"):
        balanced(chats, "some")


def test_what_the_app_reports_of_running_the_calls_rides_in_the_task_row(tmp_path):
    """Schema version 5: the app runs a reply's calls and reports each; the latest report per call
    is the task row's ``reported``, scrubbed; a turn without reports has none."""
    with PreferenceStore(tmp_path / "phone-1.db") as store:
        wake = [{"role": "user", "content": "Wake me at 6:30."}]
        two = CALL_TEXT + CALL_TEXT
        turn = store.record_turn("c1", wake, two, MODEL_A, {"tools": [ALARM]}, True)
        store.thumbs(turn, True)
        store.report_result(turn, False, "alarm app busy")
        store.report_result(turn, True, "set; told ann.lee@example.com", call=0)  # latest counts
        store.report_result(turn, False, call=1)
        store.report_result(turn, True, call=64)  # past the calls a reply is read for
        other = store.record_turn("c2", wake, CALL_TEXT, MODEL_A, {"tools": [ALARM]}, True)
        store.thumbs(other, False)
        with pytest.raises(UserError, match="ok must be True or False"):
            store.report_result(turn, "yes")
        with pytest.raises(UserError, match="call must be"):
            store.report_result(turn, True, call=-1)
        with pytest.raises(UserError, match="unknown turn id"):
            store.report_result(99, True)
    collect_feedback([tmp_path / "phone-1.db"], tmp_path / "out")
    first, second = read_jsonl(tmp_path / "out" / "tasks.jsonl")
    assert first["reported"] == [{"call": 0, "ok": True, "content": "set; told <EMAIL>"},
                                 {"call": 1, "ok": False, "content": None}]
    assert len(first["calls"]) == 2 and second["reported"] == []


def test_a_store_of_schema_version_4_is_collected_as_it_is(tmp_path):
    """A store written before call results (version 4) gives its task rows, with nothing reported,
    and is not migrated: collect reads it read-only."""
    path = tmp_path / "old-phone.db"
    old_store(path, 4, MODEL_A, json.dumps([{"role": "user", "content": "Hi"}]), "Hello.")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO feedback (turn_id, kind, created_at) VALUES (1, 'up', "
                 "'2026-01-01T00:00:01.000+00:00')")
    conn.close()
    summary = collect_feedback([path], tmp_path / "out")
    [task] = read_jsonl(tmp_path / "out" / "tasks.jsonl")
    assert (task["outcome"], task["reported"], task["device"]) == (1, [], "old-phone")
    assert summary["rows"]["demonstrations"] == 1
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 4


def test_rows_whose_messages_are_not_chat_messages_are_skipped_and_counted(tmp_path):
    """An export line whose messages are not chat messages is no feedback row; a rated answer whose
    tool calls cannot be read keeps its KTO row and makes no task row; the rest is collected."""
    hi = [{"role": "user", "content": "Hi"}]
    hello = [{"role": "assistant", "content": "Hello."}]
    bad_round = [*hi, {"role": "assistant", "content": "", "tool_calls": [1]}]
    lines = [{"prompt": [*hi, "junk"], "completion": hello, "label": True, "model_id": MODEL_A},
             {"prompt": hi, "completion": [], "label": True, "model_id": MODEL_A},
             {"prompt": bad_round, "completion": hello, "label": False, "model_id": MODEL_A},
             {"prompt": hi, "completion": hello, "label": True, "model_id": MODEL_A}]
    path = tmp_path / "phone-9.unpaired.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = collect_feedback([path], tmp_path / "out")
    assert summary["rows"] == {"pairs": 0, "unpaired": 2, "tasks": 1, "demonstrations": 1}
    assert summary["rejected"]["not_feedback_rows"] == 2
    assert summary["rejected"]["malformed_tasks"] == 1
