"""The server's refusals: OpenAI's error body, and the handlers that turn exceptions into it."""

from __future__ import annotations

import re
from typing import Optional

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from slm_align.errors import UserError

HTTP_KINDS = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}
PATH_START = r"(?<![^\s'\"(\[=])"
"""A path starts a message, or follows a space, a quote, a bracket or "=" (not a letter:
"and/or", "text/plain")."""
ABSOLUTE_PATH = re.compile(PATH_START + r"(?:~|[A-Za-z]:)?(?:[/\\][^\s'\"()\[\]/\\;,]+)+[/\\]?")
RELATIVE_PATH = re.compile(PATH_START + r"[\w.~-]+(?:[/\\][\w.@+~-]+)*[/\\][\w@+~-]+\.\w{1,8}\b")
"""A relative path is told from "application/json" by its file name's
extension (runs/demo/prefs.db)."""


class ApiError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type and a one-line message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers

    def response(self) -> JSONResponse:
        """The refusal as OpenAI's error body."""
        return error_response(self.status, str(self), self.kind, self.headers)


def error_response(status: int, message: str, kind: str, headers: Optional[dict] = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


def bad(message: str) -> ApiError:
    """A 400 for a request the server cannot take as sent."""
    return ApiError(400, message)


async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    """A refusal raised anywhere in a route."""
    return exc.response()


def client_text(exc: UserError) -> str:
    """A UserError's line as a client reads it: each filesystem path cut to its last
    part (``/srv/data/prefs.db`` -> ``prefs.db``): it says which file, never where the
    server keeps its files."""
    message = str(exc)
    for pattern in (ABSOLUTE_PATH, RELATIVE_PATH):
        message = pattern.sub(_last_part, message)
    return message


def _last_part(found: re.Match) -> str:
    return re.split(r"[/\\]", found.group(0).rstrip("/\\"))[-1]


async def on_user_error(request: Request, exc: UserError) -> JSONResponse:
    """A UserError from the runtime (a prompt beyond the context, a store that fails): the request's
    fault, a 400, without the server's paths."""
    return error_response(400, client_text(exc), "invalid_request_error")


async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (404, 405) in OpenAI's shape."""
    return error_response(exc.status_code, exc.detail, HTTP_KINDS.get(exc.status_code, "invalid_request_error"),
                          getattr(exc, "headers", None))


async def on_bug(request: Request, exc: Exception) -> JSONResponse:
    """Anything else is a bug: a 500 naming it, and the server keeps serving."""
    return error_response(500, f"internal error ({type(exc).__name__}); the server keeps running",
                          "server_error")


HANDLERS = {ApiError: on_api_error, UserError: on_user_error, HTTPException: on_http_error, Exception: on_bug}
"""Starlette's exception handlers, most specific first."""
