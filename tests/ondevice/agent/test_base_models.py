"""Base models in the runtime: a GGUF without a chat template is given one (--chat-template
chatml|FILE) or continued as plain text (chat --raw, the server's /v1/completions); without either
it is refused in one line naming both."""

import io
import json
import shutil
import sys

import pytest

from slm_align.data.agent_tasks import make_tasks
from slm_align.errors import UserError
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.agent.decode import greedy
from slm_align.ondevice.agent.open_artifact import open_backend
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.task_eval import evaluate_artifacts
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE
from slm_align.runs import artifact_manifest
from tests.helpers import run_cli

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TEXT = "Once upon a time"
QUESTION = "Tell me about a cat."


def without_template(model_dir, out):
    """A copy of ``model_dir`` whose tokenizer has no chat template (as a base model's has none)."""
    shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The bundled model as GGUF F16 twice: with its ChatML template (``chat``) and
    without any (``base``)."""
    root = tmp_path_factory.mktemp("base-models")
    plain = without_template(DEFAULT_MODEL_DIR, root / "plain")
    return {"chat": write_gguf(DEFAULT_MODEL_DIR, root / "chat.gguf", "F16"),
            "base": write_gguf(plain, root / "base.gguf", "F16"), "plain_dir": plain}


def greedy_continuation(path, text, tokens):
    """What llama.cpp continues ``text`` with, greedily, without our runtime: the
    plain-completion reference."""
    backend = open_backend(path)
    ids = greedy(backend, backend.tokenize(text), tokens)
    return backend.detokenize([i for i in ids if i not in backend.eos_ids])


def chat_cli(capsys, monkeypatch, typed, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    return run_cli(capsys, "chat", *args)


def test_the_gguf_has_no_template_and_chat_refuses_it_naming_both_options(capsys, monkeypatch, ggufs):
    assert open_backend(ggufs["base"]).chat_template is None
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", ggufs["base"])
    assert code == 2 and out == ""
    assert "--chat-template chatml" in err and "--raw" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(UserError, match="--chat-template chatml.*--raw"):
        Agent.load(ggufs["base"]).chat(QUESTION)


def test_chat_with_chatml_answers_as_the_model_with_its_own_chatml_and_records_it(capsys, monkeypatch, ggufs,
                                                                                   tmp_path):
    db = tmp_path / "prefs.db"
    code, out, _ = chat_cli(capsys, monkeypatch, QUESTION + "\n", ggufs["base"], "--chat-template", "chatml",
                            "--temperature", "0", "--max-new-tokens", "24", "--store", db, "--json")
    assert code == 0
    expected = Agent.load(ggufs["chat"], sampling=GREEDY).chat(QUESTION).text
    assert json.loads(out)["reply"] == expected and len(expected.split()) >= 3
    from slm_align.ondevice.agent.store import PreferenceStore

    with PreferenceStore(db) as store:
        assert [turn.sampling["chat_template"] for turn in store.turns()] == ["chatml"]


def test_agent_load_takes_chatml_or_a_template_file_and_a_model_keeps_its_own_otherwise(ggufs, tmp_path):
    expected = Agent.load(ggufs["chat"], sampling=GREEDY).chat(QUESTION).text
    assert Agent.load(ggufs["chat"]).backend.chat_template_origin == "artifact"
    chatml = Agent.load(ggufs["base"], chat_template="chatml", sampling=GREEDY)
    assert chatml.chat(QUESTION).text == expected and chatml.backend.chat_template_origin == "chatml"
    template = tmp_path / "turns.jinja"
    template.write_text(CHATML_TEMPLATE)
    from_file = Agent.load(ggufs["base"], chat_template=str(template), sampling=GREEDY)
    assert from_file.chat(QUESTION).text == expected
    assert from_file.backend.chat_template_origin.startswith("turns.jinja (sha256 ")
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    overridden = Agent.load(ggufs["chat"], chat_template=str(other))
    assert overridden.backend.chat_template == other.read_text()


@pytest.mark.parametrize("content, problem", [(None, "neither chatml nor a readable template file"),
                                              ("   ", "is empty"),
                                              ("{% for m in messages %}",
                                               "is not a valid Jinja template")])
def test_a_bad_template_file_is_one_line(capsys, monkeypatch, ggufs, tmp_path, content, problem):
    path = tmp_path / "bad.jinja"
    if content is not None:
        path.write_text(content)
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", ggufs["base"], "--chat-template", path)
    assert code == 2 and out == "" and problem in err and len(err.strip().splitlines()) == 1


def test_chat_raw_continues_each_line_as_plain_text(capsys, monkeypatch, ggufs):
    expected = greedy_continuation(ggufs["base"], TEXT, 12)
    code, out, _ = chat_cli(capsys, monkeypatch, TEXT + "\n", ggufs["base"], "--raw", "--temperature", "0",
                            "--max-new-tokens", "12", "--json")
    assert code == 0 and json.loads(out)["reply"] == expected and json.loads(out)["truncated"]
    code, out, err = chat_cli(capsys, monkeypatch, f"{TEXT}\n/quit\nnot continued\n",
                              ggufs["base"], "--raw",
                              "--temperature", "0", "--max-new-tokens", "12")
    assert code == 0 and out == expected + "\n" and "raw mode" in err
    assert len(expected.split()) >= 3


@pytest.mark.parametrize("flag", [["--chat-template", "chatml"], ["--tools"], ["--system", "Be terse."],
                                  ["--store", "prefs.db"]])
def test_raw_refuses_the_flags_of_a_chat(capsys, monkeypatch, ggufs, tmp_path, flag):
    monkeypatch.chdir(tmp_path)
    code, out, err = chat_cli(capsys, monkeypatch, TEXT + "\n", ggufs["base"], "--raw", *flag)
    assert code == 2 and out == "" and flag[0] in err and "--raw" in err
    assert not (tmp_path / "prefs.db").exists()


def test_export_writes_the_chosen_template_into_the_artifact_and_its_manifest(capsys, ggufs, tmp_path):
    code, _, _ = run_cli(capsys, "export", ggufs["plain_dir"], "--target", "gguf", "--quant", "F16", "--no-verify",
                           "--chat-template", "chatml", "--out", tmp_path / "export", "--json")
    assert code == 0
    artifact = tmp_path / "export" / "model-F16.gguf"
    metrics = json.loads(artifact_manifest(artifact).read_text())["metrics"]
    assert open_backend(artifact).chat_template == CHATML_TEMPLATE
    assert (metrics["chat_template"], metrics["default_chat_template"]) == ("chatml", False)
    code, _, err = run_cli(capsys, "export", ggufs["plain_dir"], "--no-verify", "--chat-template", tmp_path / "no.j2",
                           "--out", tmp_path / "refused")
    assert code == 2 and "--chat-template" in err and not (tmp_path / "refused").exists()


@pytest.fixture(scope="module")
def base_server(ggufs):
    """The template-less GGUF served as it is (no --chat-template)."""
    pytest.importorskip("openai")
    from slm_align.ondevice.agent.server import create_app
    from tests.ondevice.agent.server.test_serve import Running

    with Running(create_app(ggufs["base"])) as running:
        yield running


def test_completions_continue_plain_text_through_the_server(base_server, ggufs):
    expected = greedy_continuation(ggufs["base"], TEXT, 12)
    client = base_server.client()
    whole = client.completions.create(model="m", prompt=TEXT, max_tokens=12, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "length")
    assert whole.usage.completion_tokens == 12 and whole.object == "text_completion"
    stream = client.completions.create(model="m", prompt=TEXT, max_tokens=12, temperature=0, stream=True)
    chunks = [chunk.choices[0] for chunk in stream]
    assert "".join(choice.text for choice in chunks) == expected and len(chunks) > 3
    assert chunks[-1].finish_reason == "length"
    word = expected.split()[2]
    stopped = client.completions.create(model="m", prompt=TEXT, max_tokens=12, temperature=0, stop=word)
    assert stopped.choices[0].text == expected[:expected.find(word)] and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "--chat-template chatml"),
    ({"max_tokens": 4}, "'prompt' is required: the text to continue"),
    ({"prompt": ["a", "b"]}, "'prompt' must be non-empty text"),
    ({"prompt": "a", "echo": True}, "'echo' is not supported"),
    ({"prompt": "a", "max_tokens": 0}, "'max_tokens' must be an integer from 1 to 4096, got 0"),
])
def test_a_served_base_model_refuses_chat_and_bad_completions_in_one_line(base_server, body, message):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answer = base_server.post(route, {"model": "m", **body})
    text = answer.json()["error"]["message"]
    assert answer.status_code == 400 and message in text
    models = base_server.client().models.list().data
    assert models[0].model_extra["x_chat_template"] is None


def test_evaluate_agent_judges_a_base_model_with_the_template_given(capsys, ggufs, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in make_tasks(3, seed=1)))
    code, out, err = run_cli(capsys, "evaluate-agent", tasks, "--artifact", ggufs["base"], "--max-new-tokens", "16")
    assert code == 2 and out == "" and "--chat-template" in err and len(err.strip().splitlines()) == 1
    given = evaluate_artifacts(tasks, [ggufs["base"]], chat_template="chatml", max_tokens=16, threads=1)
    own = evaluate_artifacts(tasks, [ggufs["chat"]], max_tokens=16, threads=1)  # the same weights, ChatML inside
    replies = [[result["reply"] for result in report["artifacts"][0]["results"]] for report in (given, own)]
    assert replies[0] == replies[1]
    assert given["chat_template"] == "chatml" and own["chat_template"] is None
