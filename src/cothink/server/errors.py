"""Errors as OpenAI-style JSON ``{"error": {"message", "type", "code", "param"}}``; 4xx for client faults."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from cothink import errors as ce

log = logging.getLogger("cothink.server")


class ErrorBody(BaseModel):
    message: str = Field(description="What went wrong, for people")
    type: str = Field(
        description="Error class: invalid_request_error, authentication_error, not_found_error, "
        "conflict_error, quota_error, server_overloaded or server_error"
    )
    code: str | None = Field(
        None, description="Machine-readable code, e.g. block_busy, context_length_exceeded"
    )
    param: str | None = Field(None, description="The request field at fault, when known")


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(what: str, ident: str, code: str) -> APIError:
    return APIError(404, f"no {what} {ident!r} in this session", "not_found_error", code)


# cothink error -> (status, type, code)
_MAP: list[tuple[type[BaseException], int, str, str]] = [
    (ce.BlockBusyError, 409, "conflict_error", "block_busy"),
    (ce.PoolExhaustedError, 503, "server_overloaded", "pool_exhausted"),
    (ce.InputTooLongError, 400, "invalid_request_error", "context_length_exceeded"),
    (ce.EmptyInputError, 400, "invalid_request_error", "empty_input"),
    (ce.InvalidViewError, 400, "invalid_request_error", "invalid_view"),
    (ce.BlockFreedError, 404, "not_found_error", "block_not_found"),
    (ce.UnknownBlockError, 404, "not_found_error", "block_not_found"),
    (ce.EngineClosedError, 503, "server_overloaded", "engine_closed"),
    (ce.ModelNotFoundError, 404, "not_found_error", "model_not_found"),
    (ce.UnsupportedModelError, 400, "invalid_request_error", "unsupported"),
]


def from_exception(exc: BaseException) -> APIError:
    """The APIError for an exception an engine call raised (ValueError: a bad request)."""
    if isinstance(exc, APIError):
        return exc
    for cls, status, kind, code in _MAP:
        if isinstance(exc, cls):
            headers = {"Retry-After": "1"} if status == 503 else None
            return APIError(status, str(exc).strip("'\"") or cls.__name__, kind, code, headers=headers)
    if isinstance(exc, asyncio.CancelledError):
        return APIError(
            503,
            "the operation was cancelled (the server is shutting down or the block was released)",
            "server_overloaded",
            "cancelled",
        )
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__, "invalid_request_error", "invalid_value")
    return APIError(500, "internal server error", "server_error", "internal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    where = ".".join(loc)
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return (f"{where}: {msg}{more}" if where else f"{msg}{more}"), (where or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        content_type = request.headers.get("content-type", "")
        if request.method in ("POST", "PUT", "PATCH") and "json" not in content_type:
            message += " (send the body as JSON with 'Content-Type: application/json')"
        return APIError(400, message, "invalid_request_error", "invalid_request", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}
        codes = {404: "not_found", 405: "method_not_allowed"}
        err = APIError(
            exc.status_code,
            str(exc.detail),
            kinds.get(exc.status_code, "invalid_request_error"),
            codes.get(exc.status_code),
            headers=getattr(exc, "headers", None),
        )
        return err.response()

    @app.exception_handler(ce.CothinkError)
    async def _cothink(request: Request, exc: ce.CothinkError) -> JSONResponse:
        return from_exception(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", "server_error", "internal_error").response()


ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "Invalid request (bad field, too long input, bad view)"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown session, block, coroutine or model"},
    409: {"model": ErrorResponse, "description": "The block is being written by another coroutine"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "Session quota or server session limit reached"},
    503: {"model": ErrorResponse, "description": "Memory pool exhausted or server shutting down"},
}
