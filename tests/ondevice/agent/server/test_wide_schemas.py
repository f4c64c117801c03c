"""One request must not freeze every client (issue 36, item 1): client schemas are bounded in size, and a
request is read and checked off the event loop, so /health answers while one is being checked."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("uvicorn")

from slm_align.ondevice.agent.server import body as body_module  # noqa: E402
from slm_align.ondevice.agent.server import routes  # noqa: E402
from slm_align.ondevice.agent.server.body import MAX_SCHEMA_PROPERTIES, MAX_SCHEMA_VALUES  # noqa: E402
from tests.ondevice.agent.server import test_serve as base  # noqa: E402

onnx_model = base.onnx_model
"""The exported model and the shared server of test_serve (module fixtures,
found by these names)."""
server = base.server

HELLO = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def wide_tool(properties: int, name: str = "wide") -> dict:
    """A client tool with ``properties`` string properties."""
    names = {f"p{i}": {"type": "string"} for i in range(properties)}
    return {"type": "function", "function": {"name": name, "description": "A wide form.",
                                             "parameters": {"type": "object", "properties": names}}}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def refusal(running, body: dict) -> str:
    """The message of the 400 that ``body`` gets (any other status fails the test)."""
    response = running.post("/v1/chat/completions", {**HELLO, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    return response.json()["error"]["message"]


def test_schemas_past_the_bounds_are_400s_naming_the_limit(server):
    """The issue's 6,000-property schema was checked on the event loop for seconds (36.7 s with the grammar)."""
    assert refusal(server, {"tools": [wide_tool(6000)]}) == (
        f"tools[0].function.parameters must be a JSON schema whose objects have at most {MAX_SCHEMA_PROPERTIES} "
        "properties; one has 6000")
    many = [wide_tool(MAX_SCHEMA_PROPERTIES, f"tool{i}") for i in range(9)]  # each allowed, together too large
    assert refusal(server, {"tools": many}).startswith("'tools' hold 4635 JSON values in their parameter "
                                                       f"schemas; at most {MAX_SCHEMA_VALUES} are accepted")
    wide_format = json_schema_format(wide_tool(MAX_SCHEMA_PROPERTIES + 1)["function"]["parameters"])
    assert f"at most {MAX_SCHEMA_PROPERTIES} properties" in refusal(server, {"response_format": wide_format})
    long_enum = json_schema_format({"type": "object", "properties": {"x": {"enum": list(range(MAX_SCHEMA_VALUES))}}})
    assert f"of at most {MAX_SCHEMA_VALUES} JSON values" in refusal(server, {"response_format": long_enum})
    assert server.post("/v1/chat/completions", {**HELLO, "tools": [wide_tool(8)]}).status_code == 200


@pytest.mark.parametrize("module, step", [(routes, "parse_chat"), (body_module, "decode_json")])
def test_health_answers_while_a_wide_request_is_being_checked(server, monkeypatch, module, step):
    """The request's check (or its body's decoding) is held until /health has answered: on the event loop,
    /health would wait for it, and it for /health."""
    checking, release, real = threading.Event(), threading.Event(), getattr(module, step)

    def held(*args, **kwargs):
        checking.set()
        assert release.wait(timeout=60), "/health never answered"
        return real(*args, **kwargs)

    monkeypatch.setattr(module, step, held)
    request = {**HELLO, "tools": [wide_tool(MAX_SCHEMA_PROPERTIES)]}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.post, "/v1/chat/completions", request)
        try:
            assert checking.wait(timeout=60)
            health = httpx.get(f"{server.url}/health", timeout=30)
        finally:
            release.set()
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert answer.result().status_code == 200
