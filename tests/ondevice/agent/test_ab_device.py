"""The A/B test on the device (issue 45): ``Agent.load(base, adapters=..., candidate=...)`` routes each new
conversation to an arm, answers with that arm's adapters, and decides in the device's store as ``serve`` does;
a conversation whose id the trial did not sign is answered by the current adapters and never counted."""

import json

import pytest

from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.runs import sha256_file
from tests.helpers import save_lora

pytest.importorskip("llama_cpp")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("ab-device")
    base = write_gguf(tiny_models["llama"], root / "base.gguf")
    found = {"base": base}
    for seed, name in ((1, "a"), (2, "b")):
        lora = save_lora(tiny_models["llama"], root / f"lora{seed}", TARGETS, seed)
        found[name] = write_lora_gguf(lora, tiny_models["llama"], root / f"adapter{seed}.gguf", base_gguf=base)
    found["ids"] = {name: chain_digest(sha256_file(base), [sha256_file(found[name])]) for name in ("a", "b")}
    return found


def load(files, store, **options):
    return Agent.load(files["base"], threads=1, n_ctx=256, adapters=[files["a"]], candidate=[files["b"]],
                      store=store, consent=True, sampling=SamplingParams(temperature=0.0, max_tokens=2), **options)


def test_the_device_routes_conversations_and_promotes_a_better_candidate(files, tmp_path):
    store = tmp_path / "prefs.db"
    agent = load(files, store)
    arms = []
    for _ in range(300):
        agent.reset()
        agent.chat("Tell me a story.")
        arms.append(agent.model_id)
        agent.feedback("up" if agent.model_id == files["ids"]["b"] else "down")
        if agent.ab.trial.state != "collecting":
            break
    assert agent.ab.trial.state == "promote" and set(arms) == {files["ids"]["a"], files["ids"]["b"]}
    agent.reset()
    agent.chat("Tell me a story.")
    assert agent.model_id == files["ids"]["b"]  # promoted: the candidate answers every new conversation
    with PreferenceStore(store) as opened:
        [decision] = opened.decisions(files["ids"]["a"], files["ids"]["b"])
        assert decision["evidence"]["conversations"] >= 40 and decision["evidence"]["current_wins"] == 0
        [trial] = opened.trials()
        routed = [opened.routed_arm(turn.id) for turn in opened.turns()]
    assert trial["current_id"] == files["ids"]["a"] and routed.count(None) == 1  # the turn after the decision
    assert load(files, store).ab.trial.state == "promote"  # a restart keeps the decision


def test_a_conversation_the_trial_did_not_sign_is_not_counted(files, tmp_path):
    agent = load(files, tmp_path / "prefs.db")
    saved = tmp_path / "conversation.json"
    saved.write_text(json.dumps({"format": 1, "id": "my-own-id", "messages": []}))
    agent.restore(saved)
    agent.chat("Tell me a story.")
    agent.feedback("up")
    assert agent.model_id == files["ids"]["a"] and agent.ab.arm is None
    assert agent.store.routed_arm(agent.last.turn_id) is None
    assert agent.store.trial_observations(agent.ab.trial.id) == []
