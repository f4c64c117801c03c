"""The DNS-rebinding guard: without an API key, only requests addressed to this server
on loopback are answered.

A web page whose host name an attacker re-points at 127.0.0.1 reaches a loopback server from the
victim's browser; its requests then carry the attacker's name in ``Host`` (and its page's
``Origin``). So, unless an API key is set (a browser page cannot know it) or the user names more
hosts (``--allow-host``), a request is refused with 403 when its ``Host`` is not a loopback name
with the port the server listens on, or its ``Origin`` (when sent) is not a loopback origin. ``*``
among the allowed hosts turns the guard off.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable, Optional
from urllib.parse import urlsplit

from slm_align.ondevice.agent.server.errors import error_response

LOOPBACK_NAMES = ("localhost",)
ANY_HOST = "*"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost (an IPv6 address may come in brackets)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, Optional[int]]:
    """``name`` and ``port`` of a ``Host`` header value (``[::1]:8080``, ``localhost``); port None
    when absent or not a number."""
    parts = urlsplit(f"//{value}")
    try:
        port = parts.port
    except ValueError:
        return value, -1
    return parts.hostname or "", port


class HostGuard:
    """ASGI middleware refusing (403) requests whose ``Host`` or ``Origin`` is not
    this loopback server's."""

    def __init__(self, app, allowed_hosts: Iterable[str] = ()):
        self.app = app
        self.allowed = {host.lower().strip("[]") for host in allowed_hosts}

    async def __call__(self, scope, receive, send):
        """Refuse a request addressed to another host; pass everything else on."""
        if scope["type"] == "http" and ANY_HOST not in self.allowed:
            refusal = self._refusal(scope)
            if refusal is not None:
                response = error_response(403, refusal, "permission_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Optional[str]:
        """Why the request is refused, or None."""
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if not self._host_ok(host, _bound_port(scope)):
            return (f"Host '{host[:80]}' is not this server's address; use http://127.0.0.1:PORT/, or start the "
                    "server with --allow-host NAME (or an --api-key) to accept that name")
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_ok(origin.decode("latin-1")):
            return (f"Origin '{origin.decode('latin-1')[:80]}' is not a page of this machine; pages of other sites "
                    "may not call this server (start it with --allow-host NAME or an --api-key to allow one)")
        return None

    def _name_ok(self, name: str) -> bool:
        return is_loopback(name) or name.lower().strip("[]") in self.allowed

    def _host_ok(self, host: str, bound: Optional[int]) -> bool:
        name, port = split_host(host)
        if not self._name_ok(name):
            return False
        return bound is None or port == bound or (port is None and bound == 80)

    def _origin_ok(self, origin: str) -> bool:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and self._name_ok(parts.hostname or "")


def _bound_port(scope) -> Optional[int]:
    """The port the server listens on (None when the ASGI server does not say)."""
    server = scope.get("server")
    return server[1] if server and len(server) > 1 else None
