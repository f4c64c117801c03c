"""`serve --adapter NAME=FILE` and `--candidate FILE` (issue 35): the request's `model` picks the adapter set
that answers, swapped on the loaded base; a candidate is A/B-tested on the thumbs sent to /v1/feedback and
promotes or reverts itself, the decision and its evidence recorded in the store."""

import json
import logging
from collections import deque

import pytest

from slm_align.ondevice.agent.ab_sequential import SequentialTest
from slm_align.ondevice.agent.feedback_export import export_preferences, unpaired_path
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.runs import sha256_file
from tests.helpers import run_cli, save_lora

pytest.importorskip("llama_cpp")
TestClient = pytest.importorskip("starlette.testclient").TestClient

from slm_align.ondevice.agent.server import create_app  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HI = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models):
    """The tiny Llama's F32 GGUF and two adapters made for it."""
    root = tmp_path_factory.mktemp("serve-adapters")
    base = write_gguf(tiny_models["llama"], root / "base.gguf")
    found = {"base": base}
    for seed, name in ((1, "a"), (2, "b")):
        lora = save_lora(tiny_models["llama"], root / f"lora{seed}", TARGETS, seed)
        found[name] = write_lora_gguf(lora, tiny_models["llama"], root / f"adapter{seed}.gguf", base_gguf=base)
    found["ids"] = {"base": sha256_file(base), **{name: chain_digest(sha256_file(base), [sha256_file(found[name])])
                                                  for name in ("a", "b")}}
    return found


def client(files, store, **options):
    app = create_app(files["base"], store_path=store, consent=True, threads=1, n_ctx=256, **options)
    return TestClient(app, base_url="http://localhost")


def ask(http, conversation=None, **fields):
    body = {"messages": HI, "max_tokens": 2, "temperature": 0, **fields}
    if conversation is not None:
        body["x_conversation_id"] = conversation
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def thumbs(http, answer, up):
    verdict = {"kind": "up" if up else "down", "turn_id": answer["x_turn_id"], "turn_token": answer["x_turn_token"]}
    assert http.post("/v1/feedback", json=verdict).status_code == 200


def test_the_model_field_picks_the_adapters_that_answer(files, tmp_path):
    store = tmp_path / "prefs.db"
    with client(files, store, adapters={"a": [files["a"]], "b": [files["b"]]}) as http:
        base = http.app.state.service.model.backend.llm._model
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["default", "base.gguf", "a", "b"]
        answers = {name: ask(http, model=name, logprobs=True, top_logprobs=3) for name in ("a", "b", "base.gguf")}
        default = ask(http)
        assert http.app.state.service.model.backend.llm._model is base  # swapped on the base, never reloaded
    assert {name: answer["model"] for name, answer in answers.items()} == {n: n for n in answers}
    assert default["model"] == "a"  # the first --adapter is the default
    first = {name: answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"] for name, answer in answers.items()}
    assert first["a"] != first["b"] and first["a"] != first["base.gguf"]
    turns = {turn.id: turn for turn in PreferenceStore(store).turns()}
    recorded = {name: turns[answer["x_turn_id"]] for name, answer in answers.items()}
    assert {name: turn.model_id for name, turn in recorded.items()} == {
        "a": files["ids"]["a"], "b": files["ids"]["b"], "base.gguf": files["ids"]["base"]}
    assert recorded["b"].sampling["adapters"] == [{"file": "adapter2.gguf", "sha256": sha256_file(files["b"])}]
    assert turns[default["x_turn_id"]].model_id == files["ids"]["a"]


def test_an_unknown_model_name_is_a_400_naming_the_known_ones(files, tmp_path):
    with client(files, tmp_path / "prefs.db", adapters={"a": [files["a"]]}) as http:
        response = http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": HI, "max_tokens": 2})
        legacy = http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "Once", "max_tokens": 2})
    assert response.status_code == 400 == legacy.status_code
    message = response.json()["error"]["message"]
    assert "'gpt-4o'" in message and "default, base.gguf, a" in message


def test_without_adapters_any_model_name_is_still_answered(files, tmp_path):
    with client(files, tmp_path / "prefs.db") as http:
        assert ask(http, model="m")["model"] == "base.gguf"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base.gguf"]
        assert http.get("/v1/ab").status_code == 404


def peers(http, n=60):
    """Clients of the same server from ``n`` addresses (the A/B test caps each one)."""
    return [TestClient(http.app, base_url="http://localhost", client=(f"10.0.{k // 250}.{k % 250}", 40000))
            for k in range(n)]


def run_ab(http, candidate_up=True, limit=300, verdict=None, clients=60):
    """Conversations from many clients until the A/B test decides: thumbs up for the candidate's answers
    when ``candidate_up``, down otherwise, the current one's the opposite; or ``verdict(arm)`` for each."""
    peer = peers(http, clients)
    for i in range(limit):
        answer = ask(peer[i % clients], conversation=f"conversation-{i}")
        arm = answer["model"]
        up = verdict(arm) if verdict else (arm == "candidate") == candidate_up
        thumbs(peer[i % clients], answer, up)
        state = http.get("/v1/ab").json()
        if state["state"] != "collecting":
            return state
    raise AssertionError("the A/B test did not decide")


def test_a_better_candidate_promotes_itself_and_then_serves_everyone(files, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    store = tmp_path / "prefs.db"
    arms = {"adapters": {"current": [files["a"]]}, "candidate": files["b"]}
    with client(files, store, **arms) as http:
        state = run_ab(http, candidate_up=True)
        after = [ask(http, conversation=f"later-{i}") for i in range(8)]
        health = http.get("/health").json()
    assert state["state"] == "promote" and state["evidence"]["decision"] == "promote"
    assert state["evidence"]["candidate_wins"] > 0 == state["evidence"]["current_wins"]
    assert {answer["model"] for answer in after} == {"candidate"} and health["adapter"] == "candidate"
    assert [r.getMessage()[:28] for r in caplog.records if "A/B" in r.getMessage()] == ["A/B test: promote the candid"]
    with PreferenceStore(store) as opened:
        [decision] = opened.decisions(files["ids"]["a"], files["ids"]["b"])
        assert decision["decision"] == "promote" and decision["evidence"] == state["evidence"]
        assert {opened.turn(answer["x_turn_id"]).model_id for answer in after} == {files["ids"]["b"]}
    with client(files, store, **arms) as http:  # restarted: the decision stands
        assert http.get("/v1/ab").json()["state"] == "promote" and ask(http, conversation="x")["model"] == "candidate"


def test_a_worse_candidate_reverts_and_gets_no_more_traffic(files, tmp_path):
    store = tmp_path / "prefs.db"
    with client(files, store, adapters={"current": [files["a"]]}, candidate=files["b"], candidate_share=0.3) as http:
        state = run_ab(http, candidate_up=False)
        after = [ask(http, conversation=f"later-{i}") for i in range(8)]
    assert state["state"] == "revert" and state["candidate_share"] == 0.3
    assert {answer["model"] for answer in after} == {"current"}
    with PreferenceStore(store) as opened:
        assert [d["decision"] for d in opened.decisions(files["ids"]["a"], files["ids"]["b"])] == ["revert"]


class Balanced:
    """Verdicts under which the arms win the trial's discordant pairs in turn, whatever the order the server
    routes conversations in: a replica of its pairing
    (:func:`slm_align.ondevice.agent.ab_sequential.pairs_in_time`) tells which
    waiting conversation a new one pairs with; a waiting one's verdict alternates, and a new one makes its pair
    discordant only when that gives the arm whose turn it is the win (else concordant: no winner)."""

    def __init__(self, window=SequentialTest().window):
        self.waiting = {arm: deque(maxlen=window) for arm in ("current", "candidate")}
        self.turn = "candidate"
        self.waiters = 0

    def __call__(self, arm: str) -> bool:
        other = "candidate" if arm == "current" else "current"
        if not self.waiting[other]:
            self.waiters += 1
            self.waiting[arm].append(self.waiters % 2 == 0)
            return self.waiting[arm][-1]
        waiter_up = self.waiting[other].popleft()
        if (other if waiter_up else arm) != self.turn:
            return waiter_up
        self.turn = "current" if self.turn == "candidate" else "candidate"
        return not waiter_up


def test_a_candidate_no_different_is_kept_out_and_the_current_one_stays(files, tmp_path):
    store = tmp_path / "prefs.db"
    with client(files, store, adapters={"current": [files["a"]]}, candidate=files["b"]) as http:
        state = run_ab(http, verdict=Balanced(), limit=900, clients=100)
        after = [ask(http, conversation=f"later-{i}") for i in range(8)]
    evidence = state["evidence"]
    assert state["state"] == "keep" and evidence["llr_candidate_better"] < 0 and evidence["llr_current_better"] < 0
    assert abs(evidence["candidate_wins"] - evidence["current_wins"]) <= 1  # no side is ahead
    assert {answer["model"] for answer in after} == {"current"}
    with PreferenceStore(store) as opened:
        assert [d["decision"] for d in opened.decisions(files["ids"]["a"], files["ids"]["b"])] == ["keep"]


def test_one_client_naming_the_arms_decides_nothing(files, tmp_path):
    """Issue 45's reproduction: 14 x (model candidate + up) and 14 x (model current + down) from one client
    gave promote after 56 requests. Named arms are answered but never counted; routed ones from one
    client stop counting at its cap."""
    store = tmp_path / "prefs.db"
    with client(files, store, adapters={"current": [files["a"]]}, candidate=files["b"]) as http:
        for _ in range(14):
            thumbs(http, ask(http, model="candidate"), True)
            thumbs(http, ask(http, model="current"), False)
        named = http.get("/v1/ab").json()
        for _ in range(200):  # routed, rated by arm: the attack within the server's own routing
            answer = ask(http)
            thumbs(http, answer, answer["model"] == "candidate")
        routed = http.get("/v1/ab").json()
    assert named["state"] == "collecting" and named["evidence"]["conversations"] == 0
    assert routed["state"] == "collecting" and routed["evidence"]["conversations"] == 10
    assert routed["evidence"]["clients"] == 1 and routed["evidence"]["capped"] == 190
    with PreferenceStore(store) as opened:
        assert opened.decisions(files["ids"]["a"], files["ids"]["b"]) == []


def test_the_server_assigns_signed_conversation_ids(files, tmp_path):
    """A client's own x_conversation_id values (chosen to hash into one arm) are replaced by the server's;
    the id it hands out routes every later turn of the conversation alike."""
    with client(files, tmp_path / "prefs.db", adapters={"current": [files["a"]]}, candidate=files["b"]) as http:
        chosen = [ask(http, conversation=f"pick-{i}") for i in range(20)]
        ids = [answer["x_conversation_id"] for answer in chosen]
        again = [ask(http, conversation=conversation) for conversation in ids]
        forged = ask(http, conversation=ids[0][:-1] + ("0" if ids[0][-1] != "0" else "1"))
    assert all(conversation != f"pick-{i}" for i, conversation in enumerate(ids)) and len(set(ids)) == 20
    assert [answer["x_conversation_id"] for answer in again] == ids
    assert [answer["model"] for answer in again] == [answer["model"] for answer in chosen]
    assert {answer["model"] for answer in chosen} == {"current", "candidate"}
    assert forged["x_conversation_id"] not in ids


def test_thumbs_from_before_the_trial_do_not_count(files, tmp_path):
    """14 downs on the current set recorded before the trial, then candidate ups only: the current arm
    has no evidence from the trial, and the earlier thumbs are not in it."""
    store = tmp_path / "prefs.db"
    with client(files, store, adapters={"current": [files["a"]]}) as http:
        for _ in range(14):
            thumbs(http, ask(http), False)
    with client(files, store, adapters={"current": [files["a"]]}, candidate=files["b"]) as http:
        for other in peers(http, 40):
            answer = ask(other)
            if answer["model"] == "candidate":
                thumbs(other, answer, True)
        state = http.get("/v1/ab").json()
    assert state["state"] == "collecting"
    assert state["evidence"]["current_rated"] == 0 == state["evidence"]["pairs"]
    assert state["evidence"]["conversations"] > 0


def test_feedback_export_keeps_the_arms_apart(files, tmp_path):
    """Each exported row names the chain that answered: the next round's DPO/KTO rows know their policy."""
    store = tmp_path / "prefs.db"
    with client(files, store, adapters={"a": [files["a"]], "b": [files["b"]]}) as http:
        for name, up in (("a", True), ("b", False), ("a", True)):
            thumbs(http, ask(http, model=name), up)
    export_preferences(store, tmp_path / "prefs.jsonl")
    rows = [json.loads(line) for line in unpaired_path(tmp_path / "prefs.jsonl").read_text().splitlines()]
    assert sorted((row["model_id"], row["label"]) for row in rows) == sorted(
        [(files["ids"]["a"], True), (files["ids"]["a"], True), (files["ids"]["b"], False)])


def test_serve_refuses_bad_adapter_options_in_one_line(files, capsys, tmp_path):
    for extra, expected in ((["--adapter", str(files["a"])], "pass NAME=FILE"),
                            (["--candidate", str(files["b"])], "pass --store FILE with --candidate"),
                            (["--store", str(tmp_path / "p.db"), "--candidate", str(files["b"]),
                              "--candidate-share", "1"], "must be above 0 and below 1")):
        code, out, err = run_cli(capsys, "serve", files["base"], "--port", "0", *extra)
        assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err
