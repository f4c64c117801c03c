"""A chat template that loops or fails, where a template renders in the runtime: `chat --chat-template
FILE`, an artifact's own template (chat, evaluate-agent, serve), and a server's requests. Each is one
line and exit 2 on the CLI, a 400 naming the template on the server (never a hang, a traceback or a
500), and the server goes on answering. The bounds themselves: tests/ondevice/templates/test_sandbox.py."""

import io
import json
import shutil
import sys

import pytest

from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.ondevice.templates.chat import CHATML_TEMPLATE
from tests.helpers import run_cli

NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}")
BAD_TEMPLATES = {
    "loop": (NESTED_LOOPS, "was stopped: it took more than 1,000,000 steps"),
    "include": ("{% include 'turns.jinja' %}", "{% include %} needs another template file"),
    "undefined": ("{{ messages.foo.bar }}", "UndefinedError: 'list object' has no attribute 'foo'"),
    "float-repeat": ("{{ 'A' * 1e11 }}", "TypeError: can't multiply sequence by non-int of type 'float'"),
    "huge-repeat": ("{{ 'A' * 100000000000 }}", "was stopped: it made a value of more than 4,000,000 characters"),
    "syntax": ("{% for m in messages %}{{ m.content }}", "is not a valid Jinja template"),
    "strftime": ("{{ strftime_now('%1000Y' * 660000) }}", "was stopped: it formats a date with a pattern of more"),
    "punycode": ("{{ ('\u00e9' * 20000).encode('punycode') }}", "was stopped: it calls encode('punycode')"),
    "wordwrap": ("{{ ('a' * 1000000)|wordwrap(1) }}", "was stopped: it wraps words longer than the width"),
}
SPIN = "spin"
"""The message content on which :data:`PICKY` loops; BOOM the one on which it fails."""
BOOM = "boom"
PICKY = ("{% for m in messages %}{% if m.content == 'spin' %}" + NESTED_LOOPS + "{% endif %}"
         "{% if m.content == 'boom' %}{{ m.nothing.deeper }}{% endif %}"
         "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""ChatML, except on two messages: it renders "Hello" (the trial render passes) and fails per request."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The bundled model as GGUF F16: with its ChatML template (``chat``), and with a template in
    its metadata that loops (``looping``)."""
    root = tmp_path_factory.mktemp("template-bounds")
    looping_dir = root / "looping"
    shutil.copytree(DEFAULT_MODEL_DIR, looping_dir)
    (looping_dir / "chat_template.jinja").write_text(NESTED_LOOPS)
    return {"chat": write_gguf(DEFAULT_MODEL_DIR, root / "chat.gguf", "F16"),
            "looping": write_gguf(looping_dir, root / "looping.gguf", "F16")}


def chat_cli(capsys, monkeypatch, typed, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    return run_cli(capsys, "chat", *args)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", list(BAD_TEMPLATES))
def test_chat_with_a_template_file_that_loops_or_fails_is_one_line_and_exit_2(capsys, monkeypatch, models,
                                                                              tmp_path, name):
    source, problem = BAD_TEMPLATES[name]
    path = tmp_path / f"{name}.jinja"
    path.write_text(source)
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", models["chat"], "--chat-template", path)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{name}.jinja" in err and problem in err, err


@pytest.mark.timeout(20)
def test_an_artifact_whose_own_template_loops_is_refused_by_chat_evaluate_agent_and_serve(capsys, monkeypatch,
                                                                                          models, tmp_path):
    code, out, err = chat_cli(capsys, monkeypatch, "hello\n", models["looping"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "the model's own chat template was stopped" in err and "--chat-template chatml" in err
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    code, out, err = run_cli(capsys, "evaluate-agent", tasks, "--artifact", models["looping"])
    assert code == 2 and "the model's own chat template was stopped" in err and err.count("\n") == 1, err
    code, out, err = run_cli(capsys, "serve", models["looping"], "--port", "0")
    assert code == 2 and "the model's own chat template was stopped" in err and err.count("\n") == 1, err
    code, out, _ = chat_cli(capsys, monkeypatch, "Once upon a time\n", models["looping"], "--raw",
                            "--max-new-tokens", "4", "--json")
    assert code == 0 and json.loads(out)["truncated"]  # plain text needs no template
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    code, out, _ = chat_cli(capsys, monkeypatch, "hello\n", models["looping"], "--chat-template", template,
                            "--max-new-tokens", "4", "--json")
    assert code == 0 and "reply" in json.loads(out)  # a template in its place


@pytest.fixture(scope="module")
def picky_server(models, tmp_path_factory):
    """The chat GGUF served with :data:`PICKY` in place of its template."""
    pytest.importorskip("openai")
    from slm_align.ondevice.agent.server import create_app
    from tests.ondevice.agent.server.test_serve import Running

    template = tmp_path_factory.mktemp("picky") / "picky.jinja"
    template.write_text(PICKY)
    with Running(create_app(models["chat"], chat_template=str(template))) as running:
        yield running


def ask(server, content, **extra):
    return server.post("/v1/chat/completions", {"model": "m", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": content}], **extra})


@pytest.mark.timeout(20)
@pytest.mark.parametrize("content, problem", [(SPIN, "was stopped: it took more than 1,000,000 steps"),
                                              (BOOM, "failed to render (UndefinedError")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_on_which_the_template_loops_or_fails_is_a_400_naming_it_and_serving_goes_on(
        picky_server, content, problem, stream):
    refused = ask(picky_server, content, stream=stream)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert message.startswith("the chat template picky.jinja (sha256 ") and problem in message
    assert "/" not in message.split("picky.jinja")[0]  # the server's folders stay its own
    answered = ask(picky_server, "Hello")
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] is not None
    assert picky_server.service.worker.active == 0  # the model thread's place was given back


def test_serving_a_template_that_loops_is_refused_at_startup(models):
    from slm_align.ondevice.agent.server import create_app
    from slm_align.ondevice.templates.chat import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="the model's own chat template was stopped"):
        create_app(models["looping"])
