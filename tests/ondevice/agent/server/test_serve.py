"""`slm-align serve`: the OpenAI API driven by the official client, its limits,
and the page in Chromium."""

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from slm_align.export.publishing.stage import ExportRequest, run_export  # noqa: E402
from slm_align.modeling.models import DEFAULT_MODEL_DIR  # noqa: E402
from slm_align.ondevice.agent.runtime import Agent  # noqa: E402
from slm_align.ondevice.agent.server import create_app, is_loopback  # noqa: E402
from slm_align.ondevice.agent.settings import SamplingParams  # noqa: E402
from tests.helpers import most_repeated_name, run_cli  # noqa: E402

PROMPT = "Tell me about a cat."
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory):
    """The bundled model (ChatML template) exported once to ONNX fp32."""
    out = tmp_path_factory.mktemp("artifact")
    return run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "onnx", "fp32", out=out, verify=False)).stage_dir


def wait_until(condition, what):
    """Poll ``condition`` (a bounded number of times, so a broken server fails the test
    instead of hanging it)."""
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting: {what}")


class Running:
    """A server on a free loopback port, answering from a background thread, with the settings
    `serve` uses (connection limit, header and body deadlines, keep-alive)."""

    def __init__(self, app):
        from slm_align.ondevice.agent.server.connections import server_config

        self.app, self.service = app, app.state.service
        config = server_config(app, "warning")
        config.port = 0  # a free port
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), "the server starts")
        assert self._server.started, "the server did not start"
        self.url = f"http://127.0.0.1:{self._server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self._server.should_exit = True
        self._thread.join()

    def client(self, key="no-key"):
        """The official OpenAI client, without retries (a 5xx must show)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def post(self, path, body=None, content=None, content_type="application/json"):
        return httpx.post(f"{self.url}{path}", json=body, content=content, headers={"Content-Type": content_type},
                          timeout=60)


@pytest.fixture(scope="module")
def server(onnx_model, tmp_path_factory):
    """The shared server: records into a store, with consent, and a queue deep
    enough for the load test."""
    db = tmp_path_factory.mktemp("store") / "prefs.db"
    with Running(create_app(onnx_model, store_path=db, consent=True, max_queue=64)) as running:
        yield running


class ScriptedBackend:
    """The real backend, whose completions are scripted; ``gate`` holds each one
    after its first token."""

    def __init__(self, backend, replies, gate=None):
        self.inner, self.replies, self.gate = backend, list(replies), gate
        self.prompts, self.started = [], threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompt, params, grammar=None):
        self.prompts.append(self.inner.detokenize(prompt))
        tokens = self.inner.tokenize(self.replies.pop(0), add_special=False) + [next(iter(self.inner.eos_ids))]
        self.started.set()  # before the first token leaves: a client that has it may rely on this
        yield tokens[0]
        if self.gate is not None:
            assert self.gate.wait(timeout=60)
        yield from tokens[1:]


@contextmanager
def scripted(running, replies, gate=None):
    model = running.service.model
    real, model.backend = model.backend, ScriptedBackend(model.backend, replies, gate)
    try:
        yield model.backend
    finally:
        model.backend = real


def stored_turn(running, turn_id):
    return next(turn for turn in running.service.store.turns() if turn.id == turn_id)


# --- the OpenAI API, through the official client --------------------------------------------------


def test_chat_answers_as_the_python_agent_and_is_recorded(server, onnx_model):
    expected = Agent.load(onnx_model, sampling=SamplingParams(temperature=0, max_tokens=16)).chat(PROMPT).text
    reply = server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}],
                                                    temperature=0, max_tokens=16, seed=3)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == onnx_model.name
    assert choice.message.role == "assistant" and choice.message.content == expected and expected.strip()
    assert choice.finish_reason == ("length" if reply.usage.completion_tokens == 16 else "stop")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens > 5
    turn = stored_turn(server, reply.x_turn_id)
    assert (turn.completion, turn.consent, turn.sampling["seed"]) == (expected, True, 3)
    assert turn.messages == [{"role": "user", "content": PROMPT}]


def test_history_and_system_prompt_render_as_in_the_agent(server, onnx_model):
    agent = Agent.load(onnx_model, system="You tell stories.",
                       sampling=SamplingParams(temperature=0, max_tokens=12))
    first, second = agent.chat(PROMPT).text, agent.chat("And then?").text
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": [{"type": "text", "text": first}]},
                {"role": "user", "content": "And then?"}]
    reply = server.client().chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == second


def test_streaming_chunks_add_up_to_the_answer(server):
    request = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 16}
    whole = server.client().chat.completions.create(**request).choices[0].message.content
    chunks = list(server.client().chat.completions.create(**request, stream=True,
                                                          stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and stored_turn(server, finish[0].x_turn_id).completion == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**request, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"


def test_client_side_tools_come_back_as_tool_calls(server):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with scripted(server, [WEATHER_CALL, "It is sunny in Paris.", WEATHER_CALL]) as backend:
        reply = server.client().chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.type, call.function.name, json.loads(call.function.arguments)) == \
            ("function", "get_weather", {"city": "Paris"})

        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        final = server.client().chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
        assert final.choices[0].message.content == "It is sunny in Paris."
        assert final.choices[0].finish_reason == "stop" and "sunny, 21 C" in backend.prompts[-1]

        streamed = list(server.client().chat.completions.create(model="m", messages=messages[:1],
                                                                tools=[WEATHER_TOOL], stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == "get_weather" and deltas[0][0].index == 0
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_server_side_tools_run_in_the_loop(onnx_model, tmp_path):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>'
    with Running(create_app(onnx_model, store_path=tmp_path / "p.db", tools=True)) as running:
        with scripted(running, [call, "It is 391."]) as backend:
            reply = running.client().chat.completions.create(model="m",
                                                             messages=[{"role": "user", "content": "17*23?"}])
    assert reply.choices[0].message.content == "It is 391." and reply.choices[0].finish_reason == "stop"
    assert "391" in backend.prompts[1] and not reply.choices[0].message.tool_calls


def test_models_and_health(server, onnx_model):
    assert [m.id for m in server.client().models.list()] == [onnx_model.name]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["backend"] == "onnx" and health["store"] is True


# --- feedback -------------------------------------------------------------------------------------


def test_feedback_and_alternative_land_in_the_store(server, onnx_model):
    params = SamplingParams(temperature=0, max_tokens=12, seed=5)
    agent = Agent.load(onnx_model, sampling=params, store=server.service.store)
    agent.chat(PROMPT)
    expected_other = agent.alternative()

    reply = server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                                    temperature=0, max_tokens=12, seed=5)
    turn_id = reply.x_turn_id
    answer = {"turn_id": turn_id, "turn_token": reply.x_turn_token}
    other = server.post("/v1/alternative", answer).json()
    assert other == {"object": "alternative", "turn_id": turn_id, "content": expected_other}
    for body in ({"kind": "up"}, {"kind": "choice", "other": other["content"], "preferred": "other"},
                 {"kind": "edit", "text": "A better story."}):
        response = server.post("/v1/feedback", {**answer, **body})
        assert response.status_code == 200 and response.json()["kind"] == body["kind"]
    verdicts = stored_turn(server, turn_id).feedback
    assert [(f.kind, f.preferred, f.other_completion, f.edited_text) for f in verdicts] == [
        ("up", None, None, None), ("choice", "other", expected_other, None), ("edit", None, None, "A better story.")]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/feedback", {"turn_id": 1, "turn_token": "t", "kind": "meh"}, 400),
    ("/v1/feedback", {"turn_id": 1, "turn_token": "t", "kind": "edit"}, 400),
    ("/v1/feedback", {"turn_id": 1, "turn_token": "t", "kind": "choice", "preferred": "this"}, 400),
    ("/v1/feedback", {"turn_id": "1", "turn_token": "t", "kind": "up"}, 400),
    ("/v1/feedback", {"turn_id": 1, "kind": "up"}, 400),
    ("/v1/feedback", {"turn_id": 10 ** 9, "turn_token": "t", "kind": "up"}, 404),
    ("/v1/alternative", {"turn_id": 10 ** 9, "turn_token": "t"}, 404),
    ("/v1/alternative", {}, 400),
    ("/v1/feedback", {"turn_id": 1, "turn_token": "t", "kind": "edit", "text": "\ud800"}, 400),
])
def test_bad_feedback_is_refused(server, path, body, status):
    response = server.post(path, content=json.dumps(body).encode())  # ASCII escapes: a lone surrogate is sendable
    assert response.status_code == status and response.json()["error"]["message"]


# --- limits, errors, keys, queue ------------------------------------------------------------------


def test_bad_requests_get_json_errors_and_serving_goes_on(onnx_model):
    ok = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ({"content": b'{"messages": "' + b"x" * 5000 + b'"}'}, 413),
        ({"content": b"{not json"}, 400),
        ({"content": b"[1, 2]"}, 400),
        ({"content": b"[" * 2000 + b"]" * 2000}, 400),  # nested past the parser's depth
        ({"body": {**ok, "temperature": "hot"}}, 400),
        ({"body": {**ok, "temperature": 9}}, 400),
        ({"body": {**ok, "max_tokens": 0}}, 400),
        ({"body": {**ok, "stream": "yes"}}, 400),
        ({"body": {**ok, "n": 2}}, 400),
        ({"body": {**ok, "stop": ["a", "b", "c", "d", "e"]}}, 400),
        ({"body": {**ok, "messages": []}}, 400),
        ({"body": {**ok, "messages": [{"role": "wizard", "content": "Hi"}]}}, 400),
        ({"body": {**ok, "messages": [{"role": "user", "content": {"text": "Hi"}}]}}, 400),
        ({"body": {**ok, "messages": [{"role": "user", "content": "Hi"}] * 4}}, 400),
        ({"body": {**ok, "tools": [{"type": "function"}]}}, 400),
        ({"body": {**ok, "messages": [{"role": "user", "content": "cat " * 200}]}}, 400),  # beyond the context
        ({"content": json.dumps({**ok, "messages": [{"role": "user", "content": "\ud800"}]}).encode()}, 400),
        ({"content": b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'},
         400),  # a lone surrogate as raw bytes: json.loads lets it through
        ({"content": json.dumps({**ok, "stream": True, "messages": [{"role": "user", "content": "\ud800"}]}).encode()},
         400),
        ({"body": {**ok, "messages": [{"role": "user", "content": "Hi"},
                                      {"role": "tool", "content": "x", "tool_call_id": [1]}]}}, 400),
    ]
    with Running(create_app(onnx_model, n_ctx=128, max_body_bytes=4096, max_messages=3)) as running:
        form = running.post("/v1/chat/completions", content=json.dumps(ok).encode(), content_type="text/plain")
        assert form.status_code == 415 and form.json()["error"]["type"] == "invalid_request_error"
        for request, status in cases:
            response = running.post("/v1/chat/completions", request.get("body"), request.get("content"))
            error = response.json()["error"]
            assert (response.status_code, error["type"]) == (status, "invalid_request_error"), request
            assert error["message"] and "\n" not in error["message"]
        assert httpx.get(f"{running.url}/v1/nowhere").json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"{running.url}/v1/chat/completions").status_code == 405
        response = running.post("/v1/chat/completions", ok)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None
        assert response.json()["x_turn_id"] is None  # no store: nothing recorded
        assert running.post("/v1/feedback", {"turn_id": 1, "kind": "up"}).status_code == 400


def test_api_key_guards_every_v1_route(onnx_model):
    with Running(create_app(onnx_model, api_key="s3cret")) as running:
        for path in ("/v1/models", "/v1/chat/completions", "/v1/feedback", "/v1/nowhere"):
            response = httpx.post(f"{running.url}{path}", json={})
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        hello = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").chat.completions.create(model="m", messages=hello)
        reply = running.client("s3cret").chat.completions.create(model="m", messages=hello, max_tokens=4)
        assert reply.choices[0].message.content is not None
        assert httpx.get(f"{running.url}/health").status_code == 200 and httpx.get(f"{running.url}/").status_code == 200


def test_a_full_queue_answers_503_then_serving_goes_on(onnx_model):
    request = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    gate = threading.Event()
    with Running(create_app(onnx_model, max_queue=0)) as running:
        with scripted(running, ["first", "third"], gate) as backend, ThreadPoolExecutor(1) as pool:
            first = pool.submit(running.post, "/v1/chat/completions", request)
            assert backend.started.wait(timeout=60)
            refused = running.post("/v1/chat/completions", request)
            gate.set()
            assert first.result().json()["choices"][0]["message"]["content"] == "first"
            third = running.post("/v1/chat/completions", request)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "server_overloaded"
        assert third.json()["choices"][0]["message"]["content"] == "third"


def test_a_client_leaving_mid_stream_stops_its_answer(server):
    request = {"model": "m", "messages": [{"role": "user", "content": "A story, please."}], "stream": True}
    health = lambda: httpx.get(f"{server.url}/health").json()  # noqa: E731
    turns, abandoned, gate = server.service.store.counts()["turns"], health()["abandoned_requests"], threading.Event()
    with scripted(server, ["Once upon a time there was a cat."], gate) as backend:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=request) as response:
            lines = (line for line in response.iter_lines() if '"content": "' in line and '"content": ""' not in line)
            first = next(lines)  # the first piece; the model waits at the gate for the rest
        assert backend.started.is_set() and first.startswith("data: ")
        wait_until(lambda: health()["abandoned_requests"] > abandoned, "the server notices the client left")
        gate.set()
        wait_until(lambda: health()["active_requests"] == 0, "the model thread stops at its next piece")
    reply = server.client().chat.completions.create(model="m", messages=request["messages"], max_tokens=4)
    assert reply.choices[0].message.content is not None
    assert server.service.store.counts()["turns"] == turns + 1  # the abandoned answer was not recorded


def test_load_from_many_clients_loses_nothing(server):
    """Chats and feedback from 8 threads at once: identical greedy answers, every
    verdict stored, no 5xx."""
    store = server.service.store
    request = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 4}
    reference = server.client().chat.completions.create(**request).choices[0].message.content
    before = store.counts()

    def session(worker: int) -> tuple[list, list, int]:
        client, answers, statuses, stored = server.client(), [], [], 0
        for i in range(20):
            reply = client.chat.completions.create(**request)
            answers.append(reply.choices[0].message.content)
            response = server.post("/v1/feedback", {"turn_id": reply.x_turn_id, "turn_token": reply.x_turn_token,
                                                    "kind": "up" if i % 2 else "down"})
            statuses.append(response.status_code)
            stored += response.status_code == 200
        return answers, statuses, stored

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(session, range(8)))
    answers = [a for r in results for a in r[0]]
    statuses = [s for r in results for s in r[1]]
    after = store.counts()
    assert answers == [reference] * 160 and statuses == [200] * 160
    assert after["turns"] - before["turns"] == 160
    assert (after["up"] + after["down"]) - (before["up"] + before["down"]) == sum(r[2] for r in results) == 160


# --- the page -------------------------------------------------------------------------------------


def test_page_is_one_self_contained_file(server):
    response = httpx.get(f"{server.url}/")
    page = response.text
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    assert "getReader()" in page and "/v1/feedback" in page and "/v1/alternative" in page
    assert not any(marker in page for marker in ("http://", "https://", "<link", "src=", "@import"))


def _chromium():
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


def test_page_in_a_browser_streams_and_records_feedback(server):
    playwright = pytest.importorskip("playwright.sync_api")
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium binary (apt-get install -y chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/")
            page.wait_for_selector("body[data-ready=true]")
            page.fill("#input", PROMPT)
            page.click("#send")
            page.wait_for_selector(".answer[data-state=done]")
            answer = page.locator(".answer")
            text = answer.locator(".text").text_content()
            turn_id, chunks = int(answer.get_attribute("data-turn-id")), int(answer.get_attribute("data-chunks"))

            answer.locator("[data-action=up]").click()
            page.wait_for_selector('.answer[data-recorded~="up"]')
            answer.locator("[data-action=compare]").click()
            other = page.wait_for_selector("[data-candidate=other] .candidate-text").text_content()
            answer.locator("[data-pick=other]").click()
            page.wait_for_selector('.answer[data-recorded~="choice"]')
            shown, note = answer.locator(".text").text_content(), answer.locator(".note").text_content()
        finally:
            browser.close()
    turn = stored_turn(server, turn_id)
    assert chunks > 1 and text == turn.completion and text.strip()
    assert [(f.kind, f.preferred, f.other_completion) for f in turn.feedback] == [("up", None, None),
                                                                                  ("choice", "other", other)]
    assert shown == other and note == "recorded: Answer B preferred"


# --- packaging and the CLI ------------------------------------------------------------------------


def test_serving_imports_neither_torch_nor_transformers(onnx_model):
    code = ("import sys\nfrom starlette.testclient import TestClient\n"
            "from slm_align.ondevice.agent.server import create_app\n"
            f"with TestClient(create_app({str(onnx_model)!r}), base_url='http://127.0.0.1') as client:\n"
            "    reply = client.post('/v1/chat/completions', json={'model': 'm', 'max_tokens': 4,\n"
            "                        'messages': [{'role': 'user', 'content': 'Hi'}]})\n"
            "    assert reply.status_code == 200, reply.text\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_serve_refuses_the_network_without_a_key_and_a_taken_port(capsys, onnx_model, monkeypatch):
    monkeypatch.delenv("SLM_ALIGN_API_KEY", raising=False)
    code, out, err = run_cli(capsys, "serve", onnx_model, "--host", "0.0.0.0")
    assert code == 2 and err.count("\n") == 1 and "--api-key" in err and "--insecure" in err
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "0.0.0.0", "10.0.0.1")] == \
        [True, True, True, True, True, False, False]
    with socket.create_server(("127.0.0.1", 0)) as taken:
        code, out, err = run_cli(capsys, "serve", onnx_model, "--port", taken.getsockname()[1])
    assert code == 2 and err.count("\n") == 1 and "cannot listen on 127.0.0.1" in err and "--port" in err
    code, out, err = run_cli(capsys, "serve", "--help")
    assert code == 0 and "Examples" in out and "--api-key" in out


def test_gguf_artifact_serves_the_same_answers(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    out = tmp_path_factory.mktemp("gguf")
    gguf = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "gguf", "F16", out=out, verify=False)).stage_dir
    expected = Agent.load(gguf, sampling=SamplingParams(temperature=0, max_tokens=12)).chat(PROMPT).text
    with Running(create_app(gguf)) as running:
        health = httpx.get(f"{running.url}/health").json()
        reply = running.client().chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                                         temperature=0, max_tokens=12)
    assert health["backend"] == "gguf" and reply.choices[0].message.content == expected and expected.strip()


# --- the OpenAI surface apps use ------------------------------------------------------------------

CAT = [{"role": "user", "content": PROMPT}]


@pytest.mark.parametrize("extra, field", [
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "always", "tools": [WEATHER_TOOL]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]}, "tool_choice"),
    ({"tool_choice": "required", "tools": [WEATHER_TOOL]}, "tool_choice"),  # ONNX: no grammar
    ({"response_format": {"type": "json_object"}}, "response_format"),  # ONNX: no grammar
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "stream": True}, "logprobs"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"min_p": 1.5}, "min_p"),
])
def test_fields_that_would_change_the_answer_are_honoured_or_refused(server, extra, field):
    response = server.post("/v1/chat/completions", {"model": "m", "messages": CAT, "max_tokens": 4, **extra})
    assert response.status_code == 400 and f"'{field}'" in response.json()["error"]["message"], response.text
    harmless = {"logit_bias": {}, "modalities": ["text"], "user": "u1", "metadata": {"a": "b"}, "store": False,
                "parallel_tool_calls": True, "tool_choice": "auto", "response_format": {"type": "text"}}
    assert server.post("/v1/chat/completions", {"model": "m", "messages": CAT, "max_tokens": 2,
                                                **harmless}).status_code == 200


@pytest.mark.parametrize("path, field", [
    ("/v1/chat/completions", "grammar"),  # llama.cpp's server
    ("/v1/chat/completions", "repetition_penalty"),  # vLLM's, HF's spelling (ours: repeat_penalty)
    ("/v1/chat/completions", "reasoning_effort"),
    ("/v1/chat/completions", "min_tokens"),
    ("/v1/chat/completions", "typical_p"),
    ("/v1/completions", "grammar"),
    ("/v1/completions", "top_k"),  # a chat field, not a completion one here
    ("/v1/completions", "frequency_penalty"),
])
def test_unknown_fields_that_could_change_the_answer_are_refused(server, path, field):
    body = {"model": "m", "messages": CAT, "prompt": PROMPT, "max_tokens": 2, field: 3}
    if path == "/v1/completions":
        body.pop("messages")
    else:
        body.pop("prompt")
    response = server.post(path, body)
    assert response.status_code == 400 and f"'{field}'" in response.json()["error"]["message"], response.text


def test_fields_known_to_change_nothing_are_accepted(server):
    harmless = {"user": "u1", "metadata": {"a": "b"}, "store": True, "service_tier": "auto", "safety_identifier": "s",
                "prompt_cache_key": "k", "grammar": None}  # null: not given
    chat = server.post("/v1/chat/completions", {"model": "m", "messages": CAT, "max_tokens": 2, **harmless})
    assert chat.status_code == 200, chat.text
    legacy = server.post("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 2, "frequency_penalty": 0,
                                             **harmless})
    assert legacy.status_code == 200, legacy.text


def test_repetition_penalties_and_min_p_reach_the_sampler(server, onnx_model):
    asked = {"temperature": 0, "max_tokens": 40, "seed": 1}
    plain = server.client().chat.completions.create(model="m", messages=CAT, **asked).choices[0].message.content
    penalties = {"repeat_penalty": 2.0, "min_p": 0.05, "top_k": 20, "frequency_penalty": 1.0}
    reply = server.client().chat.completions.create(model="m", messages=CAT, **asked, extra_body=penalties)
    params = SamplingParams(temperature=0, max_tokens=40, repeat_penalty=2.0, min_p=0.05, top_k=20,
                            frequency_penalty=1.0)
    expected = Agent.load(onnx_model, sampling=params).chat(PROMPT).text
    hero = most_repeated_name(plain)  # greedily, the bundled model names its hero again and again
    assert plain.count(hero) >= 3 and reply.choices[0].message.content == expected
    assert expected.count(hero) < plain.count(hero)  # the penalties cut the repetition
    recorded = stored_turn(server, reply.x_turn_id).sampling
    assert (recorded["repeat_penalty"], recorded["min_p"], recorded["frequency_penalty"]) == (2.0, 0.05, 1.0)


def test_logprobs_when_asked(server):
    reply = server.client().chat.completions.create(model="m", messages=CAT, temperature=0, max_tokens=8,
                                                    logprobs=True, top_logprobs=3)
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == reply.usage.completion_tokens == 8
    assert "".join(t.token for t in tokens) == reply.choices[0].message.content
    for token in tokens:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob  # greedy
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
    plain = server.client().chat.completions.create(model="m", messages=CAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_several_calls_in_one_turn_come_back_and_parallel_tool_calls_false_keeps_one(server):
    calls = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>')
    ask = {"model": "m", "messages": [{"role": "user", "content": "Paris and Rome?"}], "tools": [WEATHER_TOOL]}
    with scripted(server, [calls, calls]):
        both = server.client().chat.completions.create(**ask)
        one = server.client().chat.completions.create(**ask, parallel_tool_calls=False)
    cities = [json.loads(call.function.arguments)["city"] for call in both.choices[0].message.tool_calls]
    assert cities == ["Paris", "Rome"] and both.choices[0].finish_reason == "tool_calls"
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    """The bundled model exported to GGUF F16, served (llama.cpp samples under grammars)."""
    pytest.importorskip("llama_cpp")
    out = tmp_path_factory.mktemp("gguf-server")
    gguf = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "gguf", "F16", out=out, verify=False)).stage_dir
    with Running(create_app(gguf)) as running:
        running.artifact = gguf
        yield running


def test_logprobs_on_gguf_are_the_ones_llama_cpp_reports(gguf_server):
    from llama_cpp import Llama

    reply = gguf_server.client().chat.completions.create(model="m", messages=CAT, temperature=0, max_tokens=8,
                                                         logprobs=True, top_logprobs=3)
    tokens = reply.choices[0].logprobs.content
    reference = Llama(model_path=str(gguf_server.artifact), n_ctx=512, logits_all=True, verbose=False)
    prompt = reference.tokenize(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n".encode(),
                                add_bos=False, special=True)  # the bundled model's ChatML, as the server renders it
    reported = reference.create_completion(prompt, max_tokens=8, temperature=0, repeat_penalty=1.0,
                                           logprobs=3)["choices"][0]["logprobs"]
    assert len(tokens) == reply.usage.completion_tokens == 8
    assert [token.token for token in tokens] == reported["tokens"]
    # llama.cpp's float sums depend a little on how a prompt is batched: the shared server may reuse a cached
    # prefix of an earlier test's request (4e-4 apart measured when this test ran last), the reference never does
    for token, logprob, top in zip(tokens, reported["token_logprobs"], reported["top_logprobs"]):
        assert token.logprob == pytest.approx(logprob, abs=1e-3) and token.logprob <= 0
        ours = [(alternative.token, alternative.logprob) for alternative in token.top_logprobs]
        assert [logprob for _, logprob in ours] == sorted((logprob for _, logprob in ours), reverse=True)
        assert dict(ours) == pytest.approx(top, abs=1e-3)  # the same three likeliest tokens, the same values


def _no_argument_tool(name):
    return {"type": "function", "function": {"name": name, "description": f"The {name}.",
                                             "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_required_and_named_are_honoured(gguf_server):
    """The bundled model was never taught tools: left to itself it tells a
    story; asked, it calls."""
    ask = {"model": "m", "messages": CAT, "temperature": 0, "max_tokens": 60}
    clock = _no_argument_tool("get_time")
    for tools, choice, names in (([clock, _no_argument_tool("get_date")], "required", {"get_time", "get_date"}),
                                 ([WEATHER_TOOL, clock], {"type": "function", "function": {"name": "get_time"}},
                                  {"get_time"})):
        free = gguf_server.client().chat.completions.create(**ask, tools=tools)
        assert free.choices[0].finish_reason != "tool_calls" and not free.choices[0].message.tool_calls
        reply = gguf_server.client().chat.completions.create(**ask, tools=tools, tool_choice=choice)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and call.function.name in names, choice
        assert json.loads(call.function.arguments) == {}


def test_response_format_json_schema_and_json_object(gguf_server):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "legs": {"type": "integer"}},
              "required": ["mood", "legs"], "additionalProperties": False}
    ask = {"model": "m", "messages": CAT, "temperature": 0, "max_tokens": 40}
    reply = gguf_server.client().chat.completions.create(
        **ask, response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = gguf_server.client().chat.completions.create(**ask, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(reply.choices[0].message.content), dict)
    broken = gguf_server.post("/v1/chat/completions", {**ask, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert broken.status_code == 400 and "'response_format'" in broken.json()["error"]["message"]


@pytest.fixture
def served_app(monkeypatch):
    """``serve`` from the CLI up to the point of listening: the ASGI app it would serve (uvicorn's run is
    replaced by keeping the app, and the bound socket is closed)."""
    import uvicorn

    kept = {}

    def keep(self, sockets=None):
        kept["app"] = self.config.app
        for sock in sockets or ():
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", keep)
    monkeypatch.delenv("SLM_ALIGN_API_KEY", raising=False)
    return kept


@pytest.mark.parametrize("how", ["--api-key", "SLM_ALIGN_API_KEY"])
def test_serve_from_the_cli_requires_the_key_it_was_given(capsys, monkeypatch, onnx_model, served_app, how):
    from starlette.testclient import TestClient

    args = ["serve", onnx_model, "--port", "0", "--host", "0.0.0.0"]
    if how == "--api-key":
        args += ["--api-key", "s3cret"]
    else:
        monkeypatch.setenv("SLM_ALIGN_API_KEY", "s3cret")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    client = TestClient(served_app["app"], base_url="http://board.example")
    assert client.get("/v1/models").status_code == 401  # no key
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_serve_from_the_cli_insecure_and_allow_host_are_wired(capsys, onnx_model, served_app):
    from starlette.testclient import TestClient

    code, out, err = run_cli(capsys, "serve", onnx_model, "--port", "0", "--allow-host", "board.local")
    assert code == 0, err
    client = TestClient(served_app["app"], base_url="http://board.local")
    assert client.get("/v1/models").status_code == 200  # the named host is answered
    assert client.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403  # others are not
    assert client.get("/v1/models", headers={"Host": "127.0.0.1"}).status_code == 200  # the address listened on
    code, out, err = run_cli(capsys, "serve", onnx_model, "--port", "0", "--host", "0.0.0.0", "--insecure")
    assert code == 0, err  # without a key, the network needs --insecure (refused without it: test above)
    open_client = TestClient(served_app["app"], base_url="http://10.0.0.7")
    assert open_client.get("/v1/models").status_code == 403  # no key, no allowed name: only loopback names
