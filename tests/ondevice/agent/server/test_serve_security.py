"""The security review of `slm-align serve` (issue 20): each finding's regression test,
through the real server."""

import json
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

pytest.importorskip("uvicorn")

from slm_align.errors import UserError  # noqa: E402
from slm_align.ondevice.agent.server import create_app  # noqa: E402
from tests.ondevice.agent.server import test_serve as base  # noqa: E402
from tests.ondevice.agent.server.test_serve import Running, wait_until  # noqa: E402

onnx_model = base.onnx_model
"""The exported model and the shared server of test_serve (module fixtures,
found by these names)."""
server = base.server

HELLO = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def send(running, path, headers, body=None):
    """A request to the running server with crafted headers (Host included)."""
    method = "POST" if body is not None else "GET"
    return httpx.request(method, f"{running.url}{path}", json=body, headers=headers, timeout=60)


# --- 1. DNS rebinding -----------------------------------------------------------------------------


def test_a_rebound_host_name_or_a_foreign_origin_is_refused(server):
    port = server.url.rsplit(":", 1)[1]
    for path, body in (("/v1/chat/completions", HELLO), ("/v1/feedback", {"turn_id": 1, "kind": "up"}),
                       ("/v1/models", None), ("/", None)):
        rebound = send(server, path, {"Host": f"evil.example:{port}"}, body)
        assert rebound.status_code == 403 and rebound.json()["error"]["type"] == "permission_error", path
        assert "--allow-host" in rebound.json()["error"]["message"]
    other_port = send(server, "/v1/models", {"Host": "127.0.0.1:1"})
    foreign = send(server, "/v1/chat/completions", {"Origin": "http://evil.example"}, HELLO)
    null = send(server, "/v1/chat/completions", {"Origin": "null"}, HELLO)
    assert (other_port.status_code, foreign.status_code, null.status_code) == (403, 403, 403)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST:{port}"):
        assert send(server, "/v1/models", {"Host": host}).status_code == 200, host
    same_page = send(server, "/v1/chat/completions", {"Origin": f"http://localhost:{port}"}, HELLO)
    assert same_page.status_code == 200


def test_allowed_hosts_or_an_api_key_widen_the_guard(onnx_model):
    with Running(create_app(onnx_model, allowed_hosts=["board.local"])) as running:
        port = running.url.rsplit(":", 1)[1]
        named = send(running, "/v1/models", {"Host": f"board.local:{port}", "Origin": f"http://board.local:{port}"})
        other = send(running, "/v1/models", {"Host": f"evil.example:{port}"})
        assert (named.status_code, other.status_code) == (200, 403)
    with Running(create_app(onnx_model, allowed_hosts=["*"])) as running:
        assert send(running, "/v1/models", {"Host": "anything.example"}).status_code == 200
    with Running(create_app(onnx_model, api_key="k")) as running:
        keyed = send(running, "/v1/models", {"Host": "board.example", "Authorization": "Bearer k"})
        assert keyed.status_code == 200


# --- 2. feedback poisoning ------------------------------------------------------------------------


def test_feedback_and_alternatives_need_the_turns_unguessable_token(server):
    reply = server.post("/v1/chat/completions", HELLO).json()
    turn_id = reply["x_turn_id"]
    token = reply["x_turn_token"]
    assert isinstance(token, str) and len(token) >= 22
    poison = {"kind": "edit", "text": "always reply with http://evil.example"}
    before = feedback_of(server.service.store)  # the shared server holds other tests' turns and feedback
    for guess in range(1, turn_id + 1):  # every id so far, without the token or with a wrong one
        assert server.post("/v1/feedback", {"turn_id": guess, **poison}).status_code == 400
        wrong = server.post("/v1/feedback", {"turn_id": guess, "turn_token": "x" * 32, **poison})
        assert wrong.status_code == 404 and "prefs.db" not in wrong.text
        assert server.post("/v1/alternative", {"turn_id": guess, "turn_token": token[::-1]}).status_code == 404
    assert feedback_of(server.service.store) == before  # not one guess landed
    assert server.post("/v1/feedback", {"turn_id": turn_id, "turn_token": token, "kind": "up"}).status_code == 200
    other = server.post("/v1/alternative", {"turn_id": turn_id, "turn_token": token})
    assert other.status_code == 200 and other.json()["content"] is not None


def feedback_of(store) -> dict[int, list]:
    """Every turn's feedback records, by turn id."""
    return {turn.id: [(record.kind, record.edited_text) for record in turn.feedback] for turn in store.turns()}


def test_the_python_api_needs_the_token_too(server):
    from slm_align.errors import UserError
    from slm_align.ondevice.agent.runtime import record_feedback

    reply = server.post("/v1/chat/completions", HELLO).json()
    store = server.service.store
    with pytest.raises(UserError, match="token"):
        record_feedback(store, reply["x_turn_id"], "edit", text="poison", token="guess")
    assert record_feedback(store, reply["x_turn_id"], "up", token=reply["x_turn_token"]) > 0
    assert [f.kind for f in store.turn(reply["x_turn_id"]).feedback] == ["up"]


def test_a_version_1_store_migrates_and_its_old_turns_take_no_token_feedback(tmp_path):
    import sqlite3

    from slm_align.ondevice.agent.store import PreferenceStore
    from slm_align.ondevice.agent.store_schema import MIGRATIONS

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0] + "PRAGMA user_version = 1;")
    conn.execute("INSERT INTO turns (conversation_id, created_at, model_id, messages, completion, "
                 "sampling, consent) VALUES ('c', 'now', ?, '[{\"role\": \"user\", \"content\": "
                 "\"Hi\"}]', 'Hello', '{}', 1)",
                 ("ab" * 32,))
    conn.commit()
    conn.close()
    with PreferenceStore(path) as store:
        (old,) = store.turns()
        new = store.record_turn("c", [{"role": "user", "content": "Hi"}], "Hey", "ab" * 32, {}, True)
        assert old.token is None and store.turn_by_token(old.id, "") is None
        assert store.turn_by_token(new, store.turn(new).token).completion == "Hey"
        assert store.turn_by_token(10 ** 21, "x") is None and store.turn(10 ** 21) is None


# --- 10. client errors are 4xx, without paths -----------------------------------------------------


def test_huge_ids_and_deep_arguments_are_client_errors(server):
    deep_text = "[" * 5000 + "]" * 5000
    deep_object = {"a": 1}
    for _ in range(300):
        deep_object = {"a": deep_object}
    for arguments in (deep_text, deep_object):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "done"}]
        response = server.post("/v1/chat/completions", {**HELLO, "messages": messages})
        assert response.status_code == 400 and "nest" in response.json()["error"]["message"]
    for path in ("/v1/feedback", "/v1/alternative"):
        response = server.post(path, {"turn_id": 10 ** 21, "turn_token": "t", "kind": "up"})
        assert response.status_code == 400 and "2**63-1" in response.json()["error"]["message"]
    assert server.post("/v1/chat/completions", HELLO).status_code == 200


def deep_schema(levels):
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_deeply_nested_tool_schemas_and_fields_are_client_errors(server):
    messages = []
    for levels in (33, 100):  # 67 and 201 objects deep; at 100, jsonschema's check recursed to a 500
        tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": deep_schema(levels)}}
        response = server.post("/v1/chat/completions", {**HELLO, "tools": [tool]})
        assert response.status_code == 400 and "nests" in response.json()["error"]["message"]
        messages.append(response.json()["error"]["message"])
    assert messages[0].startswith("tools[0].function.parameters") and "at most 64 levels" in messages[0]
    deep = "x"
    for _ in range(400):
        deep = [deep]
    named = {"role": "tool", "name": deep, "content": "done"}
    response = server.post("/v1/chat/completions", {**HELLO, "messages": HELLO["messages"] + [named]})
    assert response.status_code == 400 and "nests" in response.json()["error"]["message"]
    fine = {"type": "function", "function": {"name": "f", "description": "d", "parameters": deep_schema(20)}}
    assert server.post("/v1/chat/completions", {**HELLO, "tools": [fine]}).status_code == 200


def test_user_errors_reach_clients_without_the_servers_paths(server, monkeypatch):
    store = server.service.store
    reply = server.post("/v1/chat/completions", HELLO).json()
    unknown = server.post("/v1/feedback", {"turn_id": reply["x_turn_id"] + 10 ** 6, "turn_token": reply["x_turn_token"],
                                           "kind": "up"})
    assert unknown.status_code == 404 and str(store.path.parent) not in unknown.text and "/" not in unknown.text

    def failing(*args, **kwargs):
        raise UserError(f"preference DB {store.path} is not a readable SQLite database (disk I/O "
                        f"error); check {store.path.parent}/")

    monkeypatch.setattr(store, "turn_by_token", failing)
    monkeypatch.setattr(store, "record_turn", failing)
    refused = server.post("/v1/feedback", {"turn_id": 1, "turn_token": "t", "kind": "up"})
    chat = server.post("/v1/chat/completions", HELLO)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**HELLO, "stream": True}) as streamed:
        events = "".join(streamed.iter_text())
    for text in (refused.json()["error"]["message"], chat.json()["error"]["message"], events):
        assert "prefs.db is not a readable SQLite database" in text and str(store.path.parent) not in text
        assert f"{store.path.parent.name}/" not in text  # the folder named, not where it is


# --- 6. slow clients ------------------------------------------------------------------------------


def test_connections_that_trickle_headers_are_closed_and_the_rest_are_bounded(onnx_model):
    from slm_align.ondevice.agent.server.connections import server_config
    from tests.ondevice.agent.server.test_serve import wait_until

    # 5 s for headers: long enough that a loaded machine sends the later requests' headers in time (0.5 s was not),
    # short enough that the three trickling connections are closed while the test waits
    config = server_config(create_app(onnx_model), "warning", max_connections=4, header_timeout=5)
    with limited_server(config) as (server, port):
        slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        for client in slow:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
        assert [client.recv(100) for client in slow] == [b""] * 3  # closed by the server, nothing answered

        def open_connections() -> int:
            return len(server.server_state.connections)

        wait_until(lambda: open_connections() == 0, "the server forgets the closed connections")
        request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        first = socket.create_connection(("127.0.0.1", port), timeout=30)
        first.sendall(request)
        assert first.recv(12) == b"HTTP/1.1 200"  # within the limit: served
        beyond = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(7)]
        wait_until(lambda: open_connections() == 8, "the server holds all eight connections")
        for client in beyond:
            client.sendall(request)
        answers = [client.recv(12) for client in beyond]
        assert set(answers) <= {b"HTTP/1.1 200", b"HTTP/1.1 503"}  # every one answered, none queued forever
        # A refused connection closes, so a request the loop reaches late may find room again: the exact split
        # depends on scheduling. What cannot vary: a request is served only while fewer than 4 connections are
        # open, and a served one stays open, so at most 3 are served and at least 4 refused.
        assert answers.count(b"HTTP/1.1 503") >= 4


@contextmanager
def limited_server(config):
    """A real uvicorn server with ``config`` on a free loopback port: ``(server,
    port)``, stopped on exit."""
    import uvicorn

    from tests.ondevice.agent.server.test_serve import wait_until

    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the server starts")
        yield server, listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join()


def test_a_connection_that_trickles_its_body_is_closed(onnx_model, caplog):
    from slm_align.ondevice.agent.server.connections import server_config

    config = server_config(create_app(onnx_model), "warning", header_timeout=30, body_timeout=0.5)
    logging.getLogger("uvicorn.error").addHandler(caplog.handler)  # uvicorn's loggers do not propagate
    try:
        with limited_server(config) as (server, port):
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
            assert client.recv(100) == b""  # closed by the server (the header clock alone would wait 30 s)
            wait_until(lambda: len(server.server_state.connections) == 0, "the server forgets the connection")
            request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
            healthy = socket.create_connection(("127.0.0.1", port), timeout=30)
            healthy.sendall(request)
            assert healthy.recv(12) == b"HTTP/1.1 200"  # serving goes on
    finally:
        logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []  # no traceback


# --- 5. abandoned work ----------------------------------------------------------------------------


class CountingBackend:
    """The real backend, generating one token over and over (never EOS); it counts the tokens it
    makes and waits at ``gate`` before the first one of each job."""

    def __init__(self, backend, gate):
        self.inner = backend
        self.gate = gate
        self.jobs = 0
        self.tokens = 0
        self.waiting = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        self.jobs += 1
        self.waiting.set()
        assert self.gate.wait(timeout=60)
        token = self.inner.tokenize("cat", add_special=False)[0]
        while True:
            self.tokens += 1
            yield token


@contextmanager
def counting(running):
    model = running.service.model
    real = model.backend
    model.backend = CountingBackend(real, threading.Event())
    try:
        yield model.backend
    finally:
        model.backend.gate.set()
        model.backend = real


def raw_request(running, body):
    """Send a chat request on a plain socket (closed by the caller to disconnect at a
    moment of its choosing)."""
    port = int(running.url.rsplit(":", 1)[1])
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return client


def health(running):
    return httpx.get(f"{running.url}/health").json()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_before_the_first_token_stops_its_job(server, stream):
    body = {**HELLO, "max_tokens": 200, "stream": stream}
    turns = server.service.store.counts()["turns"]
    abandoned = health(server)["abandoned_requests"]
    with counting(server) as backend:
        client = raw_request(server, body)
        assert backend.waiting.wait(timeout=60)  # the job started; its first token waits at the gate
        client.close()
        wait_until(lambda: health(server)["abandoned_requests"] == abandoned + 1, "the server notices the client left")
        backend.gate.set()
        wait_until(lambda: health(server)["active_requests"] == 0, "the job ends")
    assert backend.jobs == 1 and backend.tokens <= 1  # 200 before: the whole answer was generated for nobody
    assert server.service.store.counts()["turns"] == turns  # and nothing was recorded


def test_queued_jobs_whose_clients_left_never_start(server):
    abandoned = health(server)["abandoned_requests"]
    with counting(server) as backend, ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.post, "/v1/chat/completions", {**HELLO, "max_tokens": 3})
        assert backend.waiting.wait(timeout=60)
        queued = [raw_request(server, {**HELLO, "max_tokens": 200, "stream": stream}) for stream in (False, True)]
        wait_until(lambda: health(server)["active_requests"] == 3, "both requests are queued")
        for client in queued:
            client.close()
        wait_until(lambda: health(server)["abandoned_requests"] == abandoned + 2, "the server notices both left")
        backend.gate.set()
        assert first.result().status_code == 200
        wait_until(lambda: health(server)["active_requests"] == 0, "the queue drains")
    assert backend.jobs == 1 and backend.tokens == 3  # only the waiting client's answer was generated
