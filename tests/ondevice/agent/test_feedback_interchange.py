"""The feedback interchange (issue 23, item 4): a store written by an independent writer that knows
only docs/feedback-store.md (tests/native_writer.py: plain sqlite3, standing in for a Kotlin/Swift
app) is read by `feedback export`, whose rows follow docs/feedback-rows.schema.json and train the
reward model, DPO and KTO; a store of an unknown schema is refused in one line."""

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from safetensors.torch import load_file

from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.agent.store_schema import SCHEMA_VERSION
from tests import native_writer
from tests.helpers import finished_sft_run, run_cli

ROOT = Path(__file__).resolve().parents[3]
ROWS_SCHEMA = ROOT / "docs" / "feedback-rows.schema.json"
YES = " Yes, indeed."


def layout(path: Path) -> dict:
    """Every column, index and foreign key of the store's tables, and its schema version."""
    conn = sqlite3.connect(path)
    found = {"version": conn.execute("PRAGMA user_version").fetchone()[0]}
    for table in ("turns", "feedback", "ab_decisions", "call_results"):
        found[table] = conn.execute(f"PRAGMA table_info({table})").fetchall()
        found[table + "/indexes"] = [row[1:] for row in conn.execute(f"PRAGMA index_list({table})")]
        found[table + "/keys"] = conn.execute(f"PRAGMA foreign_key_list({table})").fetchall()
    conn.close()
    return found


def test_the_spec_sql_makes_the_schema_the_store_migrates_to(tmp_path):
    native_writer.open_store(tmp_path / "native.db").close()
    PreferenceStore(tmp_path / "ours.db").close()
    assert layout(tmp_path / "native.db") == layout(tmp_path / "ours.db")
    assert layout(tmp_path / "native.db")["version"] == SCHEMA_VERSION


def test_the_writer_imports_nothing_from_slm_align():
    probe = ("import sys; sys.path.insert(0, 'tests'); import native_writer; "
             "print(sorted(m for m in sys.modules if m.startswith('slm_align')))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                            timeout=600)
    assert result.stdout.strip() == "[]"


def latest_thumb_is_up(story: int) -> bool:
    """Each thumbs is given twice, the verdicts swapped on every other thumbs
    turn; the latest counts."""
    return story % 8 == 7


def app_session(conn: sqlite3.Connection, model_id: str, turns: int) -> None:
    """Two-turn conversations with every kind of feedback; the preferred answers open with YES.
    The last turn's user withheld consent; each thumbs is given twice (up then down, or down then
    up: the latest counts)."""
    for i in range(turns):
        rest = f" It saw {i % 7} birds and a boat."
        messages = [{"role": "system", "content": "You tell stories."},
                    {"role": "user", "content": f"Story {i}: the fox went "
                                                f"to the river on day {i}."}]
        if i % 2:
            messages += [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "Go on."}]
        kind = i % 4
        completion = YES + rest if kind == 2 else rest
        turn = native_writer.record_turn(conn, f"conversation-{i // 2}", messages, completion, model_id,
                                         consent=i != turns - 1)
        if kind == 0:
            native_writer.give_feedback(conn, turn, "choice", other=YES + rest, preferred="other")
        elif kind == 1:
            native_writer.give_feedback(conn, turn, "edit", edited=YES + rest)
        elif kind == 2:
            native_writer.give_feedback(conn, turn, "choice", other=rest, preferred="this")
        else:
            verdicts = ["up", "down"]
            if latest_thumb_is_up(i):
                verdicts.reverse()
            for verdict in verdicts:
                native_writer.give_feedback(conn, turn, verdict)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("interchange") / "run", tiny_models["llama"], stories, steps=2)


def run_with_sft(sft_run, out: Path) -> Path:
    shutil.copytree(sft_run[0] / "sft", out / "sft")
    return out


def story_of(row: dict) -> int:
    """The story number of an exported row (its first user message opens "Story N:")."""
    opening = next(message["content"] for message in row["prompt"] if message["role"] == "user")
    return int(opening.split(":")[0].removeprefix("Story "))


def lora_b_tensors(adapter: Path) -> dict:
    """The LoRA up-projections of a saved adapter (PEFT initialises them to zero)."""
    weights = load_file(adapter / "adapter_model.safetensors")
    return {name: tensor for name, tensor in weights.items() if "lora_B" in name}


def assert_kto_trained(run: Path, model_id: str) -> None:
    """KTO ran its steps on the thumbs alone: the adapter moved from its zero start and the held-out
    labelled completions were measured before and after."""
    metrics = json.loads((run / "kto" / "manifest.json").read_text())["metrics"]
    assert metrics["algo"] == "kto" and metrics["steps"] == 3
    assert metrics["train_items"] + metrics["heldout_labelled"] == 11 and metrics["heldout_labelled"] >= 1
    assert metrics["heldout_pairs"] == 0 and metrics["gate"]["forced"] is True
    for figures in (metrics["heldout_before"], metrics["heldout_after"]):
        assert 0.0 <= figures["label_accuracy"] <= 1.0
    assert metrics["heldout_accuracy"]["kind"] == "label_accuracy"
    assert metrics["feedback_models"]["foreign"] == [model_id]
    up = lora_b_tensors(run / "kto" / "adapter")
    assert up and any(bool(tensor.abs().max() > 0) for tensor in up.values())
    logged = [json.loads(line) for line in (run / "kto" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2, 3] and "heldout/label_accuracy" in logged[-1]


def test_a_native_writers_store_is_exported_and_trains_the_reward_model_dpo_and_kto(sft_run, tmp_path, capsys):
    artifact = tmp_path / "model.gguf"
    artifact.write_bytes(b"GGUF stand-in: the app hashes the file it loaded")
    model_id = native_writer.artifact_digest(artifact)
    conn = native_writer.open_store(tmp_path / "app.db")
    app_session(conn, model_id, turns=48)
    conn.close()

    code, stdout, _ = run_cli(capsys, "feedback", "export", tmp_path / "app.db", "--out", tmp_path / "prefs.jsonl",
                              "--json")
    assert code == 0
    result = json.loads(stdout)
    assert (result["pairs"], result["unpaired"], result["skipped_without_consent"]) == (36, 11, 1)
    pairs = [json.loads(line) for line in (tmp_path / "prefs.jsonl").read_text().splitlines()]
    thumbs = [json.loads(line) for line in (tmp_path / "prefs.unpaired.jsonl").read_text().splitlines()]
    validator = jsonschema.Draft202012Validator(json.loads(ROWS_SCHEMA.read_text()))
    for row in pairs + thumbs:
        validator.validate(row)
    assert all(row["chosen"][0]["content"].startswith(YES) for row in pairs)
    assert all(row["label"] is latest_thumb_is_up(story_of(row)) for row in thumbs)  # the latest verdict counts
    assert {row["label"] for row in thumbs} == {False, True}
    assert {row["model_id"] for row in pairs + thumbs} == {model_id}
    assert any(len(row["prompt"]) == 4 for row in pairs)  # the conversation so far is the prompt

    reward = run_with_sft(sft_run, tmp_path / "reward-run")
    code, _, stderr = run_cli(capsys, "train", "--stage", "reward", "--out", reward, "--preferences",
                              tmp_path / "prefs.jsonl", "--no-synthetic-pairs", "--reward-steps", "3")
    assert code == 0, stderr
    manifest = json.loads((reward / "reward" / "manifest.json").read_text())
    assert "imported\": 36" in json.dumps(manifest)

    dpo = run_with_sft(sft_run, tmp_path / "dpo-run")
    args = ["train", "--algo", "dpo", "--out", dpo, "--preferences", tmp_path / "prefs.jsonl", "--force",
            "--pref-steps", "3", "--pref-batch-size", "4"]
    code, _, stderr = run_cli(capsys, *args)
    assert code == 2 and "--any-model" in stderr and len(stderr.strip().splitlines()) == 1
    code, _, stderr = run_cli(capsys, *args, "--any-model")
    assert code == 0, stderr
    record = json.loads((dpo / "dpo" / "manifest.json").read_text())["metrics"]["feedback_models"]
    assert record["foreign"] == [model_id] and record["any_model"] is True

    kto = run_with_sft(sft_run, tmp_path / "kto-run")  # the thumbs file alone; 11 answers: the gate is forced
    code, _, stderr = run_cli(capsys, "train", "--algo", "kto", "--out", kto, "--preferences",
                              tmp_path / "prefs.unpaired.jsonl", "--force", "--any-model", "--pref-steps", "3",
                              "--pref-batch-size", "4")
    assert code == 0, stderr
    assert_kto_trained(kto, model_id)


def spec_store(path: Path, edit) -> Path:
    """A store made from the spec's SQL as ``edit`` changes it (a writer's
    slip, or a future version)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(edit(native_writer.spec_sql()))
    conn.close()
    return path


def newer_version(sql: str) -> str:
    return sql.replace(f"user_version = {SCHEMA_VERSION}", f"user_version = {SCHEMA_VERSION + 1}")


def version_forgotten(sql: str) -> str:
    return sql.replace(f"PRAGMA user_version = {SCHEMA_VERSION};", "")


def token_column_missing(sql: str) -> str:
    return sql.replace(",\n    token           TEXT", "")


@pytest.mark.parametrize("edit, message", [
    (newer_version, f"schema version {SCHEMA_VERSION + 1} is newer than this slm-align supports"),
    (version_forgotten, "has tables but schema version 0; its writer must set "
                        "PRAGMA user_version = 5"),
    (token_column_missing, "table turns lacks column(s) token"),
])
def test_a_store_of_a_schema_the_code_does_not_know_is_refused_in_one_line(tmp_path, capsys, edit, message):
    store = spec_store(tmp_path / "app.db", edit)
    before = layout(store)
    code, _, stderr = run_cli(capsys, "feedback", "export", store, "--out", tmp_path / "prefs.jsonl")
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert layout(store) == before and not (tmp_path / "prefs.jsonl").exists()
