"""The security review of `slm-align serve` (issue 20): each finding's regression test, through the real server."""

import httpx
import pytest

pytest.importorskip("uvicorn")

from slm_align.agent.server import create_app  # noqa: E402
from tests import test_serve as base  # noqa: E402
from tests.test_serve import Running  # noqa: E402

onnx_model = base.onnx_model
"""The exported model and the shared server of test_serve (module fixtures, found by these names)."""
server = base.server

HELLO = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def send(running, path, headers, body=None):
    """A request to the running server with crafted headers (Host included)."""
    method = "POST" if body is not None else "GET"
    return httpx.request(method, f"{running.url}{path}", json=body, headers=headers, timeout=60)


# --- 1. DNS rebinding ---------------------------------------------------------------------------------------------


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
