"""One typed source for every sampling bound (issue 31, item 4): `slm-align chat`'s flags and the
server's request fields are the same typed fields, so both refuse a value just past a bound, in
words that name the bound, and both take the bound itself."""

import io
import json
import sys

import pytest
import typer

pytest.importorskip("uvicorn")

from slm_align.ondevice.agent.bounds import bounds, of_field, optional_peeled  # noqa: E402
from slm_align.ondevice.agent.server.chat_body import ChatBody  # noqa: E402
from slm_align.ondevice.agent.server.completions import CompletionBody  # noqa: E402
from slm_align.ondevice.agent.settings import Sampling  # noqa: E402
from tests.helpers import run_cli  # noqa: E402
from tests.ondevice.agent.server import test_serve as base  # noqa: E402

onnx_model = base.onnx_model
"""The exported model and the shared server of test_serve (module fixtures,
found by these names)."""
server = base.server

EDGES = {
    "temperature": ("a number from 0 to 2", [(-0.01, 0), (2.01, 2)]),
    "top_p": ("a number from 0 to 1", [(-0.01, 0), (1.01, 1)]),
    "top_k": ("an integer >= 0", [(-1, 0)]),
    "min_p": ("a number from 0 to 1", [(-0.01, 0), (1.01, 1)]),
    "repeat_penalty": ("a number from 1 to 2", [(0.99, 1), (2.01, 2)]),
    "frequency_penalty": ("a number from -2 to 2", [(-2.01, -2), (2.01, 2)]),
    "presence_penalty": ("a number from -2 to 2", [(-2.01, -2), (2.01, 2)]),
    "max_tokens": (("an integer >= 1", "an integer from 1 to 4096"), [(0, 1)]),
}
"""Per sampling field: what `chat` and the server say it must be (the server's max_tokens also has
its limit), and each bound's (value just past it, the bound itself)."""
OUTSIDE = [(field, outside) for field, (_, pairs) in EDGES.items() for outside, _ in pairs]
INSIDE = [(field, inside) for field, (_, pairs) in EDGES.items() for _, inside in pairs]
HI = [{"role": "user", "content": "Hi"}]


def chat_flags() -> dict[str, str]:
    """The `chat` command's flag for each of its parameters (a sampling
    field's name -> its flag)."""
    from slm_align.cli import app

    chat = typer.main.get_command(app).commands["chat"]
    return {param.name: param.opts[0] for param in chat.params}


def words(field: str) -> tuple[str, str]:
    """What `chat` and the server say ``field`` must be."""
    said = EDGES[field][0]
    return (said, said) if isinstance(said, str) else said


def test_every_bound_of_every_sampling_setting_is_checked_here():
    bounded = {field: bounds(of_field(info).metadata) for field, info in Sampling.model_fields.items()}
    assert {field for field, found in bounded.items() if found} == set(EDGES)
    for field, (_, pairs) in EDGES.items():
        assert sorted(inside for _, inside in pairs) == sorted(bounded[field].values()), field


@pytest.mark.parametrize("body", [ChatBody, CompletionBody])
def test_the_request_bodies_declare_the_flags_fields_with_the_same_types(body):
    shared = set(Sampling.model_fields) & set(body.model_fields)
    assert {"temperature", "top_p", "max_tokens", "seed"} <= shared
    for field in shared:
        ours, theirs = of_field(Sampling.model_fields[field]), optional_peeled(of_field(body.model_fields[field]))
        assert bounds(theirs.metadata) == bounds(ours.metadata), field  # the server's limit comes on top (context)
        assert theirs.description == ours.description, field
    assert set(Sampling.model_fields) <= set(ChatBody.model_fields)
    assert set(Sampling.model_fields) - {"max_tokens"} <= set(chat_flags())


@pytest.mark.parametrize("field, value",
                         OUTSIDE, ids=[f"{field}={value}" for field, value in OUTSIDE])
def test_a_value_past_a_bound_is_refused_by_chat_and_by_the_server_naming_the_bound(capsys, server, tmp_path, field,
                                                                                   value):
    flag = chat_flags()[field]
    cli_words, server_words = words(field)
    code, out, err = run_cli(capsys, "chat", tmp_path / "no-model.gguf", flag, value)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err == f"error: {flag} must be {cli_words}, got {float(value) if '.' in str(value) else value}\n"

    response = server.post("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 2, field: value})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and message == f"'{field}' must be {server_words}, got {value}"
    bound = next(inside for outside, inside in EDGES[field][1] if outside == value)
    assert str(bound) in err and str(bound) in message


@pytest.mark.parametrize("field, value",
                         INSIDE, ids=[f"{field}={value}" for field, value in INSIDE])
def test_the_bound_itself_is_taken_by_chat_and_by_the_server(capsys, monkeypatch, server, onnx_model, field, value):
    flags = chat_flags()
    length = [] if field == "max_tokens" else [flags["max_tokens"], 2]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    code, out, err = run_cli(capsys, "chat", onnx_model, "--json", *length, flags[field], value)
    assert code == 0 and "reply" in json.loads(out), err

    response = server.post("/v1/chat/completions", {"model": "m", "messages": HI, "max_tokens": 2, field: value})
    assert response.status_code == 200, response.text


def test_chat_temperature_3_is_refused_as_the_server_refuses_it(capsys, server, tmp_path):
    code, _, err = run_cli(capsys, "chat", tmp_path / "m.gguf", "--temperature", "3")
    response = server.post("/v1/chat/completions", {"model": "m", "messages": HI, "temperature": 3})
    assert code == 2 and err == "error: --temperature must be a number from 0 to 2, got 3.0\n"
    assert response.json()["error"]["message"] == "'temperature' must be a number from 0 to 2, got 3"


def test_the_servers_own_limit_on_max_tokens_is_named_too(onnx_model):
    from starlette.testclient import TestClient

    from slm_align.ondevice.agent.server import create_app

    with TestClient(create_app(onnx_model, max_tokens=8), base_url="http://127.0.0.1") as client:
        over = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 9})
        at = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
    assert over.json()["error"]["message"] == "'max_tokens' must be an integer from 1 to 8, got 9"
    assert (over.status_code, at.status_code) == (400, 200)
