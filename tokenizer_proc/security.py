"""Request guards that run before any route: the body-size limit and the pace of a body
(the API keys are `auth.py`, the Host header `host_check.py`).

Plain ASGI middlewares deciding on the request's headers and body as it arrives, so no route
can forget them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException

from ledgerserve.tokenizer_proc.errors import error_body

BODY_STALL_S = 15.0  # the longest wait for the next piece of a request body that has not ended

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class StartupRefused(RuntimeError):
    """The HTTP process must not start (e.g. an API key is required but missing)."""


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


def route_path(scope: Scope) -> str:
    """The path the routes match: the request's path without the root path (`--root-path`) when
    it carries one, as Starlette routes it; a guard deciding on the raw path could be walked past."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: from Content-Length at once, else while it streams in;
    408 for a body that stops arriving for `stall_s` before its end."""

    def __init__(self, app: ASGIApp, max_bytes: int, stall_s: float = BODY_STALL_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.stall_s = stall_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_bytes):
            status = 413 if declared.strip().isdigit() else 400
            await send_error(send, status, self._message() if status == 413 else "Invalid Content-Length header.")
            return
        await self.app(scope, self._counting(receive), send)

    def _message(self) -> str:
        return f"The request body is larger than the limit of {self.max_bytes} bytes."

    def _counting(self, receive: Receive) -> Receive:
        seen, ended = 0, False

        async def counted() -> Message:
            nonlocal seen, ended
            if ended:  # past the body: e.g. a wait for the client's disconnect, as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.stall_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"The request body stopped arriving for {self.stall_s:g} s.") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())  # becomes the OpenAI-shaped 413
            ended = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return counted
