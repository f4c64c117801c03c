"""The store's A/B records (schema version 4, issue 45): a trial resumes with its key, only the turns it
routed give observations (the first verdict of each conversation counts, re-votes add nothing), a version 3
store migrates, and conversation ids are signed so that a client cannot pick its arm."""


import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_sequential import decide
from slm_align.ondevice.agent.ab_trial import ABTrial, ConversationIds
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.agent.store_schema import SCHEMA_VERSION
from tests.helpers import old_store

CURRENT = "ab" * 32
CANDIDATE = "cd" * 32
HISTORY = [{"role": "user", "content": "Tell me a story."}]


def turn(store, conversation, model=CURRENT):
    return store.record_turn(conversation, HISTORY, "Once.", model, {}, True)


def test_a_trial_resumes_with_its_key_and_counts_only_its_routed_turns(tmp_path):
    with PreferenceStore(tmp_path / "prefs.db") as store:
        before = turn(store, "c0")
        store.thumbs(before, False)  # before the trial: not evidence
        trial = store.open_trial(CURRENT, CANDIDATE, 0.5)
        assert store.open_trial(CURRENT, CANDIDATE, 0.3) == trial and len(trial["key"]) == 64
        routed = [turn(store, "c1"), turn(store, "c1"), turn(store, "c2", CANDIDATE)]
        named = turn(store, "c3", CANDIDATE)  # asked of the candidate by name
        for each, arm in zip(routed, ("current", "current", "candidate")):
            store.record_routed(each, trial["id"], arm, "client-a")
        store.thumbs(routed[1], True)
        store.thumbs(routed[0], False)
        store.thumbs(routed[1], False)  # a re-vote
        store.thumbs(routed[2], True)
        store.thumbs(named, True)
        observations = store.trial_observations(trial["id"])
        assert store.routed_arm(routed[2]) == "candidate" and store.routed_arm(named) is None
        assert [t["id"] for t in store.trials(CANDIDATE)] == [trial["id"]] and "key" not in store.trials()[0]
        with pytest.raises(UserError, match="arm must be one of"):
            store.record_routed(named, trial["id"], "both", "x")
    assert [(o.conversation, o.arm, o.up) for o in observations] == [
        ("c1", "current", True), ("c1", "current", False), ("c1", "current", False), ("c2", "candidate", True)]
    evidence = decide(observations)
    assert (evidence.conversations, evidence.current_rated, evidence.current_up) == (2, 1, 1)  # c1's first: up


def test_a_version_3_store_migrates_keeping_its_rows(tmp_path):
    path = tmp_path / "old.db"
    old_store(path, 3, CURRENT)
    with PreferenceStore(path) as store:
        assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert store.counts()["turns"] == 1 and store.trials() == []
        assert store.open_trial(CURRENT, CANDIDATE, 0.5)["id"] == 1


def test_conversation_ids_are_signed_and_the_arm_is_keyed():
    ids = ConversationIds(b"k" * 32)
    issued = ids.new()
    assert ids.verified(issued) and ids.accept(issued) == issued
    for forged in ("conversation-1", issued[:-1] + ("0" if issued[-1] != "0" else "1"), issued + ".x", None, ""):
        assert not ids.verified(forged) and ids.accept(forged) != forged
    assert not ConversationIds(b"o" * 32).verified(issued)  # another server's key
    shares = [ids.fraction(ids.new()) for _ in range(2000)]
    assert 0.45 < sum(share < 0.5 for share in shares) / 2000 < 0.55
    assert ids.pseudonym("10.0.0.1") != ids.pseudonym("10.0.0.2") and "10.0.0.1" not in ids.pseudonym("10.0.0.1")


def test_a_trial_routes_only_its_own_ids_and_records_its_decision(tmp_path):
    with PreferenceStore(tmp_path / "prefs.db") as store:
        trial = ABTrial(store, CURRENT, CANDIDATE, share=0.5)
        assert trial.arm("mine") is None and trial.arm(trial.ids.new()) in ("current", "candidate")
        for i in range(80):
            conversation = trial.ids.new()
            arm = trial.arm(conversation)
            answered = turn(store, conversation, CANDIDATE if arm == "candidate" else CURRENT)
            trial.record(answered, arm, f"client-{i}")
            store.thumbs(answered, arm == "candidate")
            if trial.evaluate() is not None and trial.state != "collecting":
                break
        assert trial.state == "promote" and trial.arm(trial.ids.new()) is None
        [decision] = store.decisions(CURRENT, CANDIDATE)
        assert decision["evidence"]["conversations"] >= 40
        resumed = ABTrial(store, CURRENT, CANDIDATE, share=0.5)
        assert resumed.state == "promote" and resumed.id == trial.id and resumed.ids.key == trial.ids.key
