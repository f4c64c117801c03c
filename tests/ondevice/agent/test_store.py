"""The on-device preference store, its scrubber and its export to TRL-format preference data."""

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.feedback_export import export_preferences, unpaired_path
from slm_align.ondevice.agent.scrub import detectors, luhn_ok, scrub
from slm_align.ondevice.agent.store import MAX_FEEDBACK_PER_TURN, PreferenceStore
from slm_align.ondevice.agent.store_schema import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[3]
MODEL = "ab" * 32
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64}
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


def child(code: str, *args: str, **kwargs) -> subprocess.Popen:
    """A Python subprocess that imports this checkout's slm_align."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True, **kwargs)


@pytest.fixture
def store(tmp_path):
    with PreferenceStore(tmp_path / "prefs.db") as s:
        yield s


def record(store, completion="Once upon a time.",
           conversation="c1", consent=True, messages=HISTORY):
    return store.record_turn(conversation, messages, completion, MODEL, SAMPLING, consent)


# -- the store -------------------------------------------------------------------------------------

def test_turns_and_every_feedback_kind_round_trip(store):
    first = record(store)
    second = record(store, "A cat sat.", conversation="c2", consent=False)
    store.thumbs(first, up=True)
    store.choose(first, "No.", preferred="this")
    store.edit(second, "A cat sat on the mat.")
    store.thumbs(second, up=False)

    turn, other = store.turns()
    assert (turn.id, turn.conversation_id, turn.model_id, turn.messages, turn.completion, turn.sampling,
            turn.consent) == (first, "c1", MODEL, HISTORY, "Once upon a time.", SAMPLING, True)
    assert turn.created_at.endswith("+00:00")
    assert [(f.kind, f.other_completion, f.preferred, f.edited_text) for f in turn.feedback] == [
        ("up", None, None, None), ("choice", "No.", "this", None)]
    assert [(f.kind, f.edited_text) for f in other.feedback] == [("edit", "A cat sat on the mat."), ("down", None)]
    assert other.consent is False and [t.id for t in store.turns("c2")] == [second]
    assert store.counts() == {"turns": 2, "consented": 1, "up": 1, "down": 1, "choice": 1, "edit": 1}


def test_consent_is_set_per_turn_or_per_conversation(store):
    a, b = record(store, consent=False), record(store, "Two.", consent=False)
    c = record(store, "Three.", conversation="c2", consent=False)
    assert store.set_consent(a, True) == 1
    assert [t.consent for t in store.turns()] == [True, False, False]
    assert store.set_consent("c1", True) == 2 and store.set_consent(c, True) == 1
    assert store.set_consent("c1", False) == 2
    assert {t.id: t.consent for t in store.turns()} == {a: False, b: False, c: True}


@pytest.mark.parametrize("call, message", [
    (lambda s, t: s.thumbs(t + 99, up=True), "unknown turn id"),
    (lambda s, t: s.edit(t + 99, "x"), "unknown turn id"),
    (lambda s, t: s.choose(t + 99, "x", "this"), "unknown turn id"),
    (lambda s, t: s.set_consent(t + 99, True), "unknown turn id"),
    (lambda s, t: s.set_consent("nope", True), "unknown conversation id"),
    (lambda s, t: s.choose(t, "x", "mine"), "preferred must be 'this' or 'other'"),
    (lambda s, t: s.edit(t, "  "), "edited_text must be non-empty"),
    (lambda s, t: s.record_turn("c", HISTORY, "x", "not-a-hash", {}, True), "model_id must be the model artifact"),
    (lambda s, t: s.record_turn("c", [{"role": "user"}], "x", MODEL, {}, True), "messages must be a non-empty list"),
    (lambda s, t: s.record_turn("c", HISTORY, "x", MODEL, {"f": object()}, True), "sampling must be JSON"),
])
def test_bad_calls_are_user_errors_and_write_nothing(store, call, message):
    turn = record(store)
    before = store.counts()
    with pytest.raises(UserError, match=message):
        call(store, turn)
    assert store.counts() == before and len(store.turns()) == 1


def test_wal_mode_durability_and_schema_version_are_set(tmp_path):
    path = tmp_path / "prefs.db"
    PreferenceStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} >= {
        "turns", "feedback", "ab_decisions", "ab_trials", "ab_turns", "call_results"}
    conn.close()
    with PreferenceStore(path) as store:  # reopening an up-to-date file migrates nothing
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert store.counts()["turns"] == 0


def test_db_and_its_wal_files_are_owner_only(tmp_path):
    path = tmp_path / "prefs.db"
    old = os.umask(0o022)
    try:
        with PreferenceStore(path) as store:
            record(store)
            files = [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]
            assert len(files) == 3
            assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {oct(0o600)}
    finally:
        os.umask(old)


def test_a_store_made_beforehand_with_open_modes_is_tightened(tmp_path):
    path = tmp_path / "prefs.db"
    with PreferenceStore(path) as store:
        record(store)
        os.chmod(path, 0o644)
        for sibling in (Path(f"{path}-wal"), Path(f"{path}-shm")):
            os.chmod(sibling, 0o644)
        with PreferenceStore(path) as again:
            assert again.counts()["turns"] == 1
            files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
            assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {oct(0o600)}


def test_a_device_as_the_store_is_refused_before_sqlite_touches_it(tmp_path):
    link = tmp_path / "null.db"
    link.symlink_to("/dev/null")
    for target in (Path("/dev/null"), link):
        with pytest.raises(UserError, match="not a regular file"):
            PreferenceStore(target)
    assert not Path("/dev/null-journal").exists()
    assert not Path(f"{link}-journal").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null.db"]


def test_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "future.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(UserError, match=r"schema version 6 is newer .* upgrade slm-align") as info:
        PreferenceStore(path)
    assert "\n" not in str(info.value)
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # left untouched


def test_a_file_that_is_not_sqlite_is_refused(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 10)
    with pytest.raises(UserError, match="is not a SQLite database"):
        PreferenceStore(path)
    assert path.read_text().startswith("these are my notes")


def test_one_store_is_shared_by_threads(store):
    def write(n):
        for i in range(20):
            store.thumbs(record(store, f"answer {n}-{i}", conversation=f"t{n}"), up=i % 2 == 0)

    with ThreadPoolExecutor(max_workers=4) as pool:
        for done in [pool.submit(write, n) for n in range(4)]:
            done.result()  # re-raises a worker's exception
    assert store.counts() == {"turns": 80, "consented": 80, "up": 40, "down": 40, "choice": 0, "edit": 0}
    assert sorted(t.completion for t in store.turns("t3")) == sorted(f"answer 3-{i}" for i in range(20))


KILLED_WRITER = """
import sys
from concurrent.futures import ThreadPoolExecutor
from slm_align.ondevice.agent.store import PreferenceStore
store = PreferenceStore(sys.argv[1])
messages = [{"role": "user", "content": "hi"}]
i = 0
while True:
    turn = store.record_turn("c", messages, "answer %d" % i, "ab" * 32, {"temperature": 1.0}, True)
    store.thumbs(turn, up=True)
    print(turn, flush=True)
    i += 1
"""


def test_a_killed_writer_loses_nothing_committed(tmp_path):
    path = tmp_path / "prefs.db"
    writer = child(KILLED_WRITER, str(path), stdout=subprocess.PIPE)
    try:
        seen = [int(writer.stdout.readline()) for _ in range(5)]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    rest = writer.stdout.read()
    writer.stdout.close()
    printed = seen + [int(line) for line in rest.splitlines(keepends=True) if line.endswith("\n")]
    assert writer.returncode == -signal.SIGKILL and len(printed) >= 5

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    with PreferenceStore(path) as store:
        turns = {t.id: t for t in store.turns()}
    assert set(printed) <= set(turns)
    assert all([f.kind for f in turns[i].feedback] == ["up"] for i in printed)


def test_the_store_and_export_import_neither_torch_nor_transformers():
    code = ("import json, sys\nimport slm_align.ondevice.agent.store, slm_align.ondevice.agent.feedback_export, "
            "slm_align.ondevice.agent.scrub\nprint(json.dumps(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torch', 'transformers'))))")
    proc = child(code, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and json.loads(out) == []


# -- scrubbing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("write to alice.smith+tag@example.co.uk today", "write to <EMAIL> today"),
    ("call +49 30 1234567 or +1 (555) 123-4567.", "call <PHONE> or <PHONE>."),
    ("(555) 123-4567, 555-123-4567, 555 123 4567", "<PHONE>, <PHONE>, <PHONE>"),
    ("UK 020 7946 0958, NL 06-12345678, FR 01 23 45 67 89", "UK <PHONE>, NL <PHONE>, FR <PHONE>"),
    ("card 4111 1111 1111 1111, 4111-1111-1111-1111 or 4111111111111111",
     "card <CARD>, <CARD> or <CARD>"),
    ("IBAN DE89 3704 0044 0532 0130 00 or GB82WEST12345698765432.", "IBAN <IBAN> or <IBAN>."),
    ("server 192.168.1.20 and 10.0.0.1.", "server <IP> and <IP>."),
])
def test_scrub_replaces_personal_data(text, expected):
    assert scrub(text) == (expected, expected.count("<"))


@pytest.mark.parametrize("text", [
    "in 2024 I had 3 cats",
    "James Bond 007 in 2024, price 1999.99, version 3.11.7, date 2024-01-15 at "
    "12:30, room 1234, zip 90210",
    "scores 10 20 30 40 50 and years 1990 2000 2010",
    "pi is 3.14159265, population 8000000, order 1234567890123456 (not Luhn-valid)",
    "ISO 9001, USB3, COVID19 and AB12 word",
])
def test_scrub_keeps_ordinary_numbers(text):
    assert scrub(text) == (text, 0)


def test_luhn():
    assert luhn_ok("4111111111111111") and luhn_ok("79927398713")
    assert not luhn_ok("4111111111111112") and not luhn_ok("1234567890123456")


# -- export ----------------------------------------------------------------------------------------

def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def assistant(text):
    return [{"role": "assistant", "content": text}]


@pytest.fixture
def filled(tmp_path):
    """A store with each feedback kind, on consented turns and on one turn without consent."""
    path = tmp_path / "prefs.db"
    with PreferenceStore(path) as store:
        won = record(store, "Once upon a time.")
        store.choose(won, "No.", preferred="this")
        lost = record(store, "Meh.")
        store.choose(lost, "A dragon woke up.", preferred="other")
        edited = record(store, "A cat.")
        store.edit(edited, "A cat sat on the mat.")
        liked = record(store, "A fox ran.")
        store.thumbs(liked, up=False)
        store.thumbs(liked, up=True)  # the latest verdict counts
        disliked = record(store, "Story.")
        store.thumbs(disliked, up=False)
        private = record(store, "Secret story.", conversation="private", consent=False)
        store.thumbs(private, up=True)
        store.edit(private, "Secret edit.")
    return path


def test_export_writes_pairs_and_unpaired_rows_the_right_way_round(filled, tmp_path):
    out = tmp_path / "out" / "prefs.jsonl"
    result = export_preferences(filled, out)
    assert result == {"pairs": 3, "unpaired": 2, "skipped_without_consent": 2, "skipped_identical": 0,
                      "scrubbed_replacements": 0, "scrubbed_by": detectors(), "out": str(out),
                      "unpaired_out": str(tmp_path / "out" / "prefs.unpaired.jsonl")}
    assert read_jsonl(out) == [
        {"prompt": HISTORY, "chosen": assistant("Once upon a time."), "rejected": assistant("No."), "model_id": MODEL},
        {"prompt": HISTORY, "chosen": assistant("A dragon woke up."), "rejected": assistant("Meh."), "model_id": MODEL},
        {"prompt": HISTORY, "chosen": assistant("A cat sat on the mat."), "rejected": assistant("A cat."),
         "model_id": MODEL},
    ]
    assert read_jsonl(unpaired_path(out)) == [
        {"prompt": HISTORY, "completion": assistant("A fox ran."), "label": True, "model_id": MODEL},
        {"prompt": HISTORY, "completion": assistant("Story."), "label": False, "model_id": MODEL},
    ]
    assert "Secret" not in out.read_text() + unpaired_path(out).read_text()
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in (out, unpaired_path(out))} == {oct(0o600)}
    assert sorted(p.name for p in out.parent.iterdir()) == ["prefs.jsonl", "prefs.unpaired.jsonl"]  # no temp files


def test_exported_pairs_load_through_the_preference_importer(filled, tmp_path, tokenizer):
    from slm_align.data.preferences import read_preferences

    out = tmp_path / "prefs.jsonl"
    export_preferences(filled, out)
    pairs = read_preferences(out, tokenizer)
    assert [(p.chosen, p.rejected) for p in pairs] == [
        ("Once upon a time.<|im_end|>\n", "No.<|im_end|>\n"),
        ("A dragon woke up.<|im_end|>\n", "Meh.<|im_end|>\n"),
        ("A cat sat on the mat.<|im_end|>\n", "A cat.<|im_end|>\n"),
    ]
    assert pairs[0].prompt.endswith("<|im_start|>user\nTell me a "
                                    "story.<|im_end|>\n<|im_start|>assistant\n")


def test_export_scrubs_prompts_and_answers(tmp_path):
    path = tmp_path / "prefs.db"
    with PreferenceStore(path) as store:
        messages = [{"role": "user", "content": "I am bob@example.com, in 2024 I had 3 cats"}]
        turn = record(store, "Call +44 20 7946 0958.", messages=messages)
        store.edit(turn, "Pay with 4111 1111 1111 1111.")
    out = tmp_path / "prefs.jsonl"
    result = export_preferences(path, out, scrub=True)
    assert result["scrubbed_replacements"] == 3
    assert read_jsonl(out) == [{"prompt": [{"role": "user", "content": "I am <EMAIL>, in 2024 I had 3 cats"}],
                                "chosen": assistant("Pay with <CARD>."), "rejected": assistant("Call <PHONE>."),
                                "model_id": MODEL}]
    with PreferenceStore(path) as store:  # the store itself keeps the original text
        assert store.turns()[0].completion == "Call +44 20 7946 0958."


def test_export_refuses_to_overwrite_unless_asked(filled, tmp_path):
    out = tmp_path / "prefs.jsonl"
    unpaired_path(out).write_text("old\n")
    with pytest.raises(UserError, match="prefs.unpaired.jsonl exists; pass --overwrite"):
        export_preferences(filled, out)
    assert not out.exists() and unpaired_path(out).read_text() == "old\n"
    assert export_preferences(filled, out, overwrite=True)["unpaired"] == 2
    assert len(read_jsonl(unpaired_path(out))) == 2


def test_export_without_consented_feedback_is_refused(tmp_path):
    path = tmp_path / "prefs.db"
    with PreferenceStore(path) as store:
        store.thumbs(record(store, consent=False), up=True)
        record(store)  # consented, but no feedback
    out = tmp_path / "prefs.jsonl"
    with pytest.raises(UserError, match="no consented feedback in DB"):
        export_preferences(path, out)
    assert not out.exists() and not unpaired_path(out).exists()


@pytest.mark.parametrize("store_name, out_name, message", [
    ("missing.db", "prefs.jsonl", "missing.db not found"),
    ("prefs.db", "prefs.csv", "name the output with .jsonl"),
])
def test_export_bad_paths_are_user_errors(filled, tmp_path, store_name, out_name, message):
    with pytest.raises(UserError, match=message):
        export_preferences(tmp_path / store_name, tmp_path / out_name)
    assert not (tmp_path / "missing.db").exists()


def test_a_flood_of_feedback_on_one_turn_is_bounded_and_exports_one_pair(tmp_path):
    db = tmp_path / "prefs.db"
    with PreferenceStore(db) as store:
        turn = store.record_turn("c", [{"role": "user", "content": "Tell me a story."}], "Once.", "ab" * 32, {},
                                 True)
        for i in range(MAX_FEEDBACK_PER_TURN - 2):
            store.choose(turn, f"alternative {i} " + "x" * 100, "other")
        store.edit(turn, "Once upon a time.")
        store.thumbs(turn, up=False)
        with pytest.raises(UserError, match="most one turn keeps"):
            store.choose(turn, "one more alternative", "other")
        assert len(store.turn(turn).feedback) == MAX_FEEDBACK_PER_TURN  # the refused one was not stored
    result = export_preferences(db, tmp_path / "round.jsonl")
    assert (result["pairs"], result["unpaired"]) == (1, 1)  # one pair (the latest: the edit), one verdict
    (pair,) = [json.loads(line) for line in (tmp_path / "round.jsonl").read_text().splitlines()]
    assert pair["chosen"][-1]["content"] == "Once upon a time."
