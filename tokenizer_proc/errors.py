"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ledgerserve.tokenizer_proc.engine_client import EngineError
from ledgerserve.tokenizer_proc.protocol import InvalidParam
from ledgerserve.tokenizer_proc.request_fields import shown_name

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    def __init__(
        self, status_code: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status_code = status_code
        self.message = message
        self.param = param


def error_body(status_code: int, message: str, param: str | None = None, error_type: str | None = None) -> dict:
    kind = error_type or ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


RETRY_AFTER_S = 1  # what every 503 tells a client to wait before it tries again


def error_response(
    status_code: int, message: str, param: str | None = None, error_type: str | None = None
) -> JSONResponse:
    """The OpenAI-shaped error; a 503 (overloaded, every on-demand adapter in use, not ready,
    shutting down, the engine failed) says when to retry: `Retry-After`."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status_code == 503 else None
    return JSONResponse(error_body(status_code, message, param, error_type), status_code=status_code, headers=headers)


BODY_ERRORS = {
    "json_invalid": "The request body is not valid JSON.",
    "model_attributes_type": "The request body must be a JSON object (sent as application/json).",
    "missing": "The request body is empty; send a JSON object.",
}


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """The first pydantic error as a 400 naming its top-level field (None: the whole body).

    The message names the exact place (`messages.0.content`), without pydantic's union-branch
    labels (`str`, `list[TextPart]`); when the field is a union, it gives what each branch wanted
    at the deepest place any branch reached."""
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    raw_loc = tuple(first.get("loc", ()))
    if raw_loc[:1] == ("body",) and (len(raw_loc) == 1 or first.get("type") == "json_invalid"):
        return error_response(400, BODY_ERRORS.get(str(first.get("type")), "The request body is invalid."))
    if first.get("type") == "extra_forbidden" and len(raw_loc) == 2:  # a body model that forbids unknown fields
        name = shown_name(str(raw_loc[1]))
        return error_response(400, f"`{name}` is not a known field of this request", name)
    body = getattr(exc, "body", None)
    path, message = describe(
        [(field_path(e.get("loc", ()), body, e.get("type")), str(e.get("msg", "invalid value"))) for e in errors]
    )
    where = ".".join(path)
    return error_response(400, f"{where}: {message}" if where else message, path[0] if path else None)


def describe(located: list[tuple[tuple[str, ...], str]]) -> tuple[tuple[str, ...], str]:
    """Of (path, message) errors, the first error's field: its deepest path any error reached
    (a union's best-matching branches) and their messages joined."""
    field = located[0][0][:1]
    same_field = [(path, msg) for path, msg in located if path[:1] == field]
    deepest = max((path for path, _ in same_field), key=len)
    messages = dict.fromkeys(msg for path, msg in same_field if path == deepest)
    return deepest, "; or ".join(messages)


def field_path(loc: Sequence[Any], body: Any, error_type: Any) -> tuple[str, ...]:
    """A pydantic error location as the path into the request body: keys and indices the body
    has, and a missing field's name; union-branch labels (`str`, `list[int]`) are left out."""
    parts = list(loc[1:]) if tuple(loc[:1]) == ("body",) else list(loc)
    if body is None:
        return tuple(shown_name(str(part)) for part in parts)
    path: list[str] = []
    node = body
    for i, part in enumerate(parts):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (error_type == "missing" and i == len(parts) - 1 and isinstance(node, dict)):
            continue  # a union-branch label, not a place in the body
        path.append(shown_name(str(part)))
    return tuple(path)


def redacting(secret_paths: tuple[str, ...]) -> Callable[[str], str]:
    """A function that replaces each server path (e.g. the model directory) with `<server path>`."""
    paths = sorted({p for path in secret_paths if path for p in (path, os.path.realpath(path))}, key=len, reverse=True)

    def redact(message: str) -> str:
        for path in paths:
            message = message.replace(path, "<server path>")
        return message

    return redact


def install_error_handlers(app: FastAPI, secret_paths: tuple[str, ...] = ()) -> None:
    """OpenAI-shaped errors for everything; `secret_paths` never appear in a message."""
    redact = redacting(secret_paths)

    def respond(
        status_code: int, message: str, param: str | None = None, error_type: str | None = None
    ) -> JSONResponse:
        return error_response(status_code, redact(message), param, error_type)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)  # pydantic messages never echo the input

    @app.exception_handler(InvalidParam)
    async def _on_invalid(_: Request, exc: InvalidParam) -> JSONResponse:
        return respond(400, exc.message, exc.param)

    @app.exception_handler(ApiError)
    async def _on_api(_: Request, exc: ApiError) -> JSONResponse:
        response = respond(exc.status_code, exc.message, exc.param)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(EngineError)
    async def _on_engine(_: Request, exc: EngineError) -> JSONResponse:
        return respond(exc.status_code, exc.message, exc.param, exc.error_type)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _on_any(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return respond(500, f"internal error: {type(exc).__name__}")
