"""The HTTP connections this process holds: none sits idle for long, and there are never so
many that the process runs out of file descriptors (when accept() fails, /health fails too).

uvicorn closes a kept-alive connection `timeout_keep_alive` s after its last response, but a
connection that never sends a request, or sends its headers a byte at a time, is held forever.
`GuardedHttpToolsProtocol` (uvicorn's httptools protocol, given to uvicorn as its `http` class):

- closes a connection whose request headers are not complete HEADER_TIMEOUT_S after it opened
  or after its last response;
- keeps the number of connections at most `connection_cap()`: the soft RLIMIT_NOFILE (read at
  each new connection) less FD_RESERVE for the process's other files and sockets. A connection
  past the cap closes the connection that has waited longest without a request in progress
  (opened but silent, or kept alive after a response), so an idle flood cannot lock new
  clients out; only when every connection is busy does the new one get a 503 (OpenAI error
  shape, `Retry-After`) and close.

`raise_fd_limit()` lifts the soft RLIMIT_NOFILE to the hard one at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ledgerserve.tokenizer_proc.errors import error_body

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive: a kept-alive connection closes this long after its response
FD_RESERVE = 128  # descriptors kept for everything but connections: IPC sockets, pipes, files
MAX_FD_LIMIT = 1 << 20  # the soft limit set when the hard one is unlimited
RETRY_AFTER_S = 1

logger = logging.getLogger(__name__)


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_FD_LIMIT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap() -> int:
    """The most connections this process holds: its open-file limit less FD_RESERVE (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = MAX_FD_LIMIT if soft == resource.RLIM_INFINITY else soft
    return max(1, limit - FD_RESERVE)


def _busy_response() -> bytes:
    message = "The server holds as many connections as it can, all of them busy; retry later."
    body = json.dumps(error_body(503, message)).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a connection cap (module docstring)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused = False
        self._idle_since = self.loop.time()
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()
        if len(self.connections) > connection_cap() and not self._close_longest_idle():
            self._refused = True
            transport.write(_busy_response())
            transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = self.loop.time()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def is_idle(self) -> bool:
        """No request in progress: opened or kept alive, its next request's headers not complete."""
        return not self._refused and (self.cycle is None or self.cycle.response_complete)

    def _close_longest_idle(self) -> bool:
        idle = [
            c for c in self.connections if c is not self and isinstance(c, GuardedHttpToolsProtocol) and c.is_idle()
        ]
        idle = [c for c in idle if not c.transport.is_closing()]  # closed already, not yet gone from the set
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        oldest.transport.close()
        return True

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.is_idle() and not self.transport.is_closing():
            self.transport.close()


def _evictable(connection: object) -> bool:
    """An idle connection not closed already (a closed one leaves the set a moment later)."""
    return (
        isinstance(connection, GuardedHttpToolsProtocol)
        and connection.is_idle()
        and not connection.transport.is_closing()
    )
