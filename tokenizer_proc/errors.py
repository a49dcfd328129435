"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenizer_proc.engine_client import EngineError
from tokenizer_proc.protocol import InvalidParam

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param


def error_body(status_code: int, message: str, param: str | None = None, error_type: str | None = None) -> dict:
    kind = error_type or ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


def error_response(status_code: int, message: str, param: str | None = None, error_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, error_type), status_code=status_code)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid request"))
    return error_response(400, message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(InvalidParam)
    async def _on_invalid(_: Request, exc: InvalidParam) -> JSONResponse:
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(ApiError)
    async def _on_api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param)

    @app.exception_handler(EngineError)
    async def _on_engine(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.error_type)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _on_any(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")
