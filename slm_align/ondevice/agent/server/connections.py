"""What one client may hold of the server: a bounded number of connections, and little
time to send its request.

uvicorn bounds concurrent connections (``limit_concurrency``: 503 beyond it) and idle keep-alive
time, but not how long a client may take to send a request: 20 clients trickling a header line every
few seconds held 20 connections for as long as they liked, and so did one trickling its body a byte
at a time. :class:`RequestDeadline` closes a connection whose request headers are not complete
``header_timeout`` seconds after it opened (or after its previous response), or whose body is not
complete ``body_timeout`` seconds after its headers. Beyond loopback, put a reverse proxy in front
(README: "Security"); these limits are the server's own floor, not a substitute.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 64
"""Connections (and their requests) served at once; more get 503."""
HEADER_TIMEOUT = 10.0
"""Seconds a client has to send a request's headers."""
BODY_TIMEOUT = 30.0
"""Seconds a client has, once its headers are in, to send the body (1 MiB at
most: 35 KB/s is enough)."""
KEEP_ALIVE_TIMEOUT = 5
"""Seconds an idle kept-alive connection stays open."""
SENDING = (h11.IDLE, h11.SEND_BODY)
"""The client's states while its request is still arriving."""


class RequestDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing connections whose request headers or body
    do not arrive in time."""

    def __init__(self, *args: Any, header_timeout: float = HEADER_TIMEOUT, body_timeout: float = BODY_TIMEOUT,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self._deadline: Optional[Any] = None
        self._body_clock = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        """Start the clock for the first request's headers."""
        super().connection_made(transport)
        self._arm(self.header_timeout)

    def handle_events(self) -> None:
        """Once the headers are in, the body's clock; once the body is in, no clock."""
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY and not self._body_clock:
            self._arm(self.body_timeout)
            self._body_clock = True
        if state not in SENDING:
            self._disarm()

    def on_response_complete(self) -> None:
        """Start the clock again for the next request on a kept-alive connection."""
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.header_timeout)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        """No clock for a closed connection."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._body_clock = False
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        if self.conn.their_state in SENDING and not self.transport.is_closing():
            self.transport.close()


def server_config(app, log_level: str = "info", max_connections: int = MAX_CONNECTIONS,
                  header_timeout: float = HEADER_TIMEOUT, body_timeout: float = BODY_TIMEOUT) -> Config:
    """uvicorn's settings for serving ``app``: bounded connections, header and body
    deadlines, short keep-alive."""
    protocol = partial(RequestDeadline, header_timeout=header_timeout, body_timeout=body_timeout)
    return Config(app, log_level=log_level, timeout_graceful_shutdown=5, limit_concurrency=max_connections,
                  timeout_keep_alive=KEEP_ALIVE_TIMEOUT, http=protocol)
