"""A fleet's A/B decision (issue 45): `slm-align feedback ab STORES...` pools the devices' routed
conversations into one sequential test, each device capped, so that several devices decide together what
none decides alone; a file that is not a store is one line and exit 2."""

import json

from slm_align.ondevice.agent.ab_fleet import fleet_decision
from slm_align.ondevice.agent.ab_sequential import SequentialTest
from slm_align.ondevice.agent.ab_trial import ABTrial
from slm_align.ondevice.agent.store import PreferenceStore
from tests.helpers import run_cli

CURRENT = "ab" * 32
CANDIDATE = "cd" * 32
HISTORY = [{"role": "user", "content": "Tell me a story."}]


def device(path, conversations, candidate_up=True, candidate=CANDIDATE):
    """A device's store after ``conversations`` routed conversations, each rated once: the candidate's up
    and the current one's down when ``candidate_up`` (else the opposite)."""
    with PreferenceStore(path) as store:
        trial = ABTrial(store, CURRENT, candidate, test=trial_test())
        for _ in range(conversations):
            conversation = trial.ids.new()
            arm = trial.arm(conversation)
            turn = store.record_turn(conversation, HISTORY, "Once.", candidate if arm == "candidate" else CURRENT,
                                     {}, True)
            trial.record(turn, arm, conversation)
            store.thumbs(turn, (arm == "candidate") == candidate_up)
    return path


def trial_test():
    return SequentialTest(min_conversations=10 ** 6)  # the devices never decide alone here


def test_devices_decide_together_what_none_decides_alone(tmp_path, capsys):
    stores = [device(tmp_path / f"d{i}.db", 20) for i in range(6)]
    assert all(fleet_decision([store])["decision"] == "collecting" for store in stores)
    code, out, err = run_cli(capsys, "feedback", "ab", *stores, "--json")
    result = json.loads(out)
    assert code == 0 and result["decision"] == "promote" and result["devices"] >= 3
    assert result["evidence"]["current_wins"] == 0 and result["candidate_id"] == CANDIDATE
    code, out, _ = run_cli(capsys, "feedback", "ab", *stores)
    assert code == 0 and " ".join(out.split()).startswith("A/B promote: candidate cdcdcdcdcdcd against ababababab")


def test_one_loud_device_is_capped(tmp_path):
    loud = device(tmp_path / "loud.db", 400)
    quiet = device(tmp_path / "quiet.db", 6, candidate_up=False)
    result = fleet_decision([loud, quiet])
    assert result["decision"] == "collecting" and result["evidence"]["conversations"] == 20 + 6
    assert result["evidence"]["capped"] >= 300
    assert fleet_decision([loud, quiet], max_per_device=400)["decision"] == "promote"  # the cap is what holds


def test_devices_may_send_their_observations_instead_of_their_stores(tmp_path, capsys):
    """`feedback ab prefs.db --observations FILE` writes a device's evidence without text; the fleet reads
    those files (mixed with stores) to the same decision."""
    stores = [device(tmp_path / f"d{i}.db", 20) for i in range(6)]
    files = []
    for i, store in enumerate(stores[:4]):
        files.append(tmp_path / f"d{i}.ab.jsonl")
        code, out, _ = run_cli(capsys, "feedback", "ab", store, "--observations", files[-1], "--json")
        assert code == 0 and json.loads(out)["observations"]["rows"] == 20
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert set(rows[0]) == {"current_id", "candidate_id", "arm", "up", "conversation", "at", "client"}
    assert oct(files[0].stat().st_mode & 0o777) == oct(0o600)
    assert fleet_decision(files + stores[4:]) == fleet_decision(stores)
    code, out, err = run_cli(capsys, "feedback", "ab", stores[0], "--observations", files[0])
    assert code == 2 and "exists" in err and err.count("\n") == 1


def test_a_file_that_is_not_a_store_is_one_line_and_exit_2(tmp_path, capsys):
    store = device(tmp_path / "d.db", 4)
    export = tmp_path / "prefs.jsonl"
    export.write_text('{"prompt": []}\n')
    for args, expected in (([store, export], "prefs.jsonl line 1 is not an A/B observation"),
                           ([store, store], "named twice"), ([store, tmp_path / "missing.db"], "not found"),
                           ([store, store.with_name("x.db"), "--observations", tmp_path / "o.jsonl"],
                            "pass one store")):
        code, out, err = run_cli(capsys, "feedback", "ab", *args)
        assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err
    assert export.read_text() == '{"prompt": []}\n'


def test_stores_of_several_candidates_need_one_named(tmp_path, capsys):
    stores = [device(tmp_path / "a.db", 4), device(tmp_path / "b.db", 4, candidate="ef" * 32)]
    code, out, err = run_cli(capsys, "feedback", "ab", *stores)
    assert code == 2 and "--candidate MODEL_ID" in err and err.count("\n") == 1
    code, out, _ = run_cli(capsys, "feedback", "ab", *stores, "--candidate", "ef" * 32, "--json")
    assert code == 0 and json.loads(out)["candidate_id"] == "ef" * 32
