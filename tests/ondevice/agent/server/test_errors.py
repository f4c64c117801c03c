"""The server's refusals (server/errors.py): OpenAI's error body, path hiding, exception handlers."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.exceptions import HTTPException

from slm_align.errors import UserError
from slm_align.ondevice.agent.server.errors import (
    HANDLERS,
    ApiError,
    bad,
    client_text,
    on_bug,
    on_http_error,
    on_user_error,
)


def body(response) -> dict:
    return json.loads(response.body)


def test_api_error_response_is_openai_shaped():
    """status, type, message and headers reach the body (mutation: kind or status dropped from the body)."""
    response = ApiError(401, "give the key", "authentication_error", {"WWW-Authenticate": "Bearer"}).response()
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert body(response) == {"error": {"message": "give the key", "type": "authentication_error",
                                        "param": None, "code": 401}}


def test_bad_is_a_400_invalid_request():
    """bad() makes a 400 of type invalid_request_error (mutation: another status or kind)."""
    error = bad("no messages")
    assert (error.status, error.kind, str(error)) == (400, "invalid_request_error", "no messages")


@pytest.mark.parametrize("message, shown", [
    ("cannot open /srv/data/prefs.db: locked", "cannot open prefs.db: locked"),
    ("store 'runs/demo/prefs.db' is read-only", "store 'prefs.db' is read-only"),
    ("path=/home/me/x/model.gguf missing", "path=model.gguf missing"),
    (r"open C:\Users\me\store.db failed", "open store.db failed"),
    ("~/secret/dir/ is full", "dir is full"),
])
def test_client_text_cuts_paths_to_their_last_part(message, shown):
    """A client never reads where the server keeps files (mutation: a path pattern dropped)."""
    assert client_text(UserError(message)) == shown


@pytest.mark.parametrize("message", [
    "send application/json, not text/plain",
    "pass a tool and/or a schema",
    "a ratio of 3/4 is too high",
])
def test_client_text_keeps_words_that_are_not_paths(message):
    """Media types, 'and/or' and fractions are not paths (mutation: PATH_START or the extension rule loosened)."""
    assert client_text(UserError(message)) == message


def test_user_error_is_a_400_without_paths():
    """A UserError from the runtime is the request's fault (400), paths cut (mutation: 500, or raw text)."""
    response = asyncio.run(on_user_error(None, UserError("cannot read /etc/slm/key.txt")))
    assert response.status_code == 400
    assert body(response)["error"]["message"] == "cannot read key.txt"


def test_http_errors_take_openai_kinds():
    """404 -> not_found_error, 401 -> authentication_error, others invalid_request_error (mutation: map ignored)."""
    kinds = {}
    for status in (404, 401, 418):
        response = asyncio.run(on_http_error(None, HTTPException(status, "nope")))
        assert response.status_code == status
        kinds[status] = body(response)["error"]["type"]
    assert kinds == {404: "not_found_error", 401: "authentication_error", 418: "invalid_request_error"}


def test_bug_is_a_500_naming_only_the_exception_type():
    """A bug's message never reaches the client, only its type (mutation: str(exc) leaked)."""
    response = asyncio.run(on_bug(None, KeyError("/srv/secret")))
    assert response.status_code == 500
    error = body(response)["error"]
    assert error["type"] == "server_error"
    assert "KeyError" in error["message"] and "secret" not in error["message"]


def test_handlers_most_specific_first():
    """ApiError and UserError are handled before the catch-all (mutation: order or a handler lost)."""
    keys = list(HANDLERS)
    assert keys.index(ApiError) < keys.index(Exception)
    assert keys.index(UserError) < keys.index(Exception)
    assert HANDLERS[UserError] is on_user_error
