"""Round two from the field, end to end on the bundled model (issue 47, item 3), through the CLI as a user runs
it: a round shipped as an adapter bundle, a simulated fleet's feedback collected, ``train --algo kto`` on the
collected rows, the new adapter exported and shipped as an update that applies on the device, and the A/B test
of the update against the current round deciding on the fleet.

The models' answers in the field are scripted by question (``tests/ondevice/agent/test_field_simulate.py``'s
:class:`AnswerBook`), so what the users rate, and which arm is better, is known here; what is trained, exported,
bundled and routed is real."""

import json

import pytest

from slm_align.data.function_tasks import function_tasks
from slm_align.export.packaging.adapter_bundle import apply_update
from tests.helpers import run_cli
from tests.ondevice.agent.test_field_simulate import LONG, by_questions, right_questions, scripted

pytest.importorskip("llama_cpp")


def test_round_two_trains_on_field_feedback_ships_and_is_ab_tested(tmp_path, capsys, monkeypatch):
    tasks = function_tasks(train=24, heldout=16, seed=0)
    rows = tasks["heldout"]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in tasks["sft"]))
    (tmp_path / "field.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"

    def cli(*args):
        code, out, err = run_cli(capsys, *args, "--json")
        assert code == 0, err
        return json.loads(out)

    cli("sft", "--data", tmp_path / "sft.jsonl", "--max-steps", 2, "--batch-size", 4,
        "--out", run)
    cli("export", run, "--target", "gguf-adapter")
    v1 = cli("bundle", run / "export" / "adapter-sft-F16.gguf", "--out", tmp_path / "app-v1")

    scripted(monkeypatch, rows, by_questions(right_questions(rows)))
    field = cli("field", "simulate", "--artifact", tmp_path / "app-v1", "--tasks", tmp_path / "field.jsonl",
                "--devices", 3, "--turns-per-device", 10, "--noise", 0, "--unrated", 0.2,
                "--max-new-tokens", LONG, "--out", tmp_path / "field")
    collected = cli("feedback", "collect", *sorted((tmp_path / "field").glob("*.db")), "--out", tmp_path / "round2")
    assert collected["rows"]["unpaired"] == field["rated"] and 0 < field["ups"] < field["rated"]

    trained = cli("train", "--algo", "kto", "--out", run, "--preferences", tmp_path / "round2" / "unpaired.jsonl",
                  "--pref-steps", 2, "--force")
    assert trained["metrics"]["steps"] == 2 and trained["metrics"]["train_items"] > 0
    exported = cli("export", run, "--target", "gguf-adapter")
    assert [entry["stage"] for entry in exported["metrics"]["adapters"]] == ["sft", "kto"]
    update = cli("bundle", run / "export" / "adapter-kto-F16.gguf", "--update-from", tmp_path / "app-v1",
                 "--out", tmp_path / "v2-update")
    v2 = apply_update(tmp_path / "app-v1", tmp_path / "v2-update", tmp_path / "app-v2", allow_unsigned=True)
    assert v2["model_id"] == update["model_id"] == exported["metrics"]["sha256"]

    def candidate_right(row, backend):
        return any(adapter["file"].startswith("adapter-kto") for adapter in backend.adapters)
    scripted(monkeypatch, rows, candidate_right)
    ab = cli("field", "simulate", "--artifact", tmp_path / "app-v1", "--candidate", tmp_path / "app-v2",
             "--tasks", tmp_path / "field.jsonl", "--devices", 4, "--turns-per-device", 30, "--noise", 0,
             "--unrated", 0, "--max-new-tokens", LONG, "--seed", 4, "--out", tmp_path / "ab")
    assert (ab["ab"]["current_id"], ab["ab"]["candidate_id"]) == (v1["model_id"], v2["model_id"])
    decision = cli("feedback", "ab", *sorted((tmp_path / "ab").glob("*.db")))
    assert decision["decision"] == "promote" and decision["candidate_id"] == v2["model_id"]
    assert decision["evidence"]["current_wins"] == 0 and decision["evidence"]["pairs"] >= 20
