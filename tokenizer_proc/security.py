"""Request guards that run before any route: the API key and the body-size limit.

Both are plain ASGI middlewares deciding on the request path and headers, so no route can
forget them. The API key travels to this process only in LEDGERSERVE_API_KEY.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException

from ledgerserve.shared import env
from ledgerserve.tokenizer_proc.errors import error_body

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # they run the tokenizer and template, as /v1 does

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class StartupRefused(RuntimeError):
    """The HTTP process must not start (e.g. an API key is required but missing)."""


def api_key_from_env(required: bool) -> str | None:
    """The key to enforce, or None when none is configured; refuses a required-but-empty key."""
    key = env.api_key()
    if required and not key:
        raise StartupRefused(
            f"an API key is required (--api-key) but {env.API_KEY} is empty in the "
            "HTTP process; refusing to start without authentication"
        )
    return key or None


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


def key_matches(authorization: bytes | None, key: bytes) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    if authorization is None:
        return False
    scheme, _, given = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(given.strip(), key)


class ApiKeyMiddleware:
    """401 for any `/v1`, `/tokenize` or `/detokenize` request without the right Bearer key;
    other paths stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope.get("path", "")):
            if not key_matches(_header(scope, b"authorization"), self.key):
                await send_error(
                    send,
                    401,
                    "Invalid or missing API key; send `Authorization: Bearer <key>`.",
                    {"www-authenticate": "Bearer"},
                )
                return
        await self.app(scope, receive, send)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: from Content-Length at once, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_bytes):
            status = 413 if declared.strip().isdigit() else 400
            await send_error(send, status, self._message() if status == 413 else "Invalid Content-Length header.")
            return
        await self.app(scope, self._counting(receive), send)

    def _message(self) -> str:
        return f"The request body is larger than the limit of {self.max_bytes} bytes."

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())  # becomes the OpenAI-shaped 413
            return message

        return counted
