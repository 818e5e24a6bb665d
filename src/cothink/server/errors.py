"""Errors as OpenAI-style JSON ``{"error": {"message", "type", "code", "param"}}``; 4xx for client faults."""

from __future__ import annotations

import asyncio
import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from cothink import errors as ce
from cothink.structured.grammar import GrammarError

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
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote user input, which may hold lone surrogates
    (valid in JSON escapes, not encodable as UTF-8)."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class ClientGone(Exception):
    """The client disconnected while its request was being worked on: nobody reads the reply."""


def not_found(what: str, ident: str, code: str) -> APIError:
    return APIError(404, f"no {what} {ident!r} in this session", "not_found_error", code)


# cothink error -> (status, type, code): the one place engine errors become HTTP
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
    (ce.SnapshotMismatchError, 409, "conflict_error", "snapshot_mismatch"),  # saved from another model
    (ce.SnapshotError, 400, "invalid_request_error", "snapshot_invalid"),  # not a (readable) snapshot
    (ce.InvalidTokenIdError, 400, "invalid_request_error", "invalid_token_id"),
    (GrammarError, 400, "invalid_request_error", "grammar_error"),  # a schema beyond the matcher's limits
    (ce.InvalidParameterError, 400, "invalid_request_error", "invalid_value"),  # param names the field
]


def from_exception(exc: BaseException) -> APIError:
    """The APIError for an exception an engine call raised (ValueError: a bad request)."""
    if isinstance(exc, APIError):
        return exc
    param = getattr(exc, "param", None)  # engine errors name the offending parameter when they know it
    for cls, status, kind, code in _MAP:
        if isinstance(exc, cls):
            headers = {"Retry-After": "1"} if status == 503 else None
            message = str(exc).strip("'\"") or cls.__name__
            return APIError(status, message, kind, code, param, headers=headers)
    if isinstance(exc, asyncio.CancelledError):
        return APIError(
            503,
            "the operation was cancelled (the server is shutting down or the block was released)",
            "server_overloaded",
            "cancelled",
        )
    if isinstance(exc, UnicodeError):
        return APIError(400, "the text is not valid Unicode", "invalid_request_error", "invalid_text", param)
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__, "invalid_request_error", "invalid_value", param)
    return APIError(500, "internal server error", "server_error", "internal_error")


_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})  # pydantic union members


def field_path(loc: tuple | list) -> str | None:
    """The request field a pydantic error location names: 'messages.0.content', never a union tag like
    'stop.constrained-str' or a byte offset. None when the location is not a field."""
    parts: list[str] = []
    for p in loc:
        if p in ("body", "query", "path", "header") and not parts:
            continue
        if isinstance(p, int) and parts:
            parts.append(str(p))
        elif isinstance(p, str) and _FIELD.match(p) and p not in _TYPE_TAGS:
            parts.append(p)
        else:
            break  # a union member, a validator name or an offset: the field is what came before
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic errors (HTTP bodies and WebSocket messages alike)."""
    if not errors:
        return APIError(400, "invalid request", "invalid_request_error", "invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, "the body is not valid JSON", "invalid_request_error", "invalid_json")
    ctx_error = (first.get("ctx") or {}).get("error")
    param = getattr(ctx_error, "param", None) or field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    message = f"{param}: {msg}{more}" if param else f"{msg}{more}"
    return APIError(400, message, "invalid_request_error", "invalid_request", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        content_type = request.headers.get("content-type", "")
        if request.method in ("POST", "PUT", "PATCH") and "json" not in content_type:
            err.message += " (send the body as JSON with 'Content-Type: application/json')"
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}
        # 400 here: a body the framework could not parse (bytes that are not JSON, nesting too deep)
        codes = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
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

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> JSONResponse:
        err = APIError(499, "the client closed the request", "invalid_request_error", "client_gone")
        return err.response()

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
    403: {"model": ErrorResponse, "description": "Host or Origin not allowed, or the listing needs a key"},
    429: {"model": ErrorResponse, "description": "Quota (memory, sessions, blocks, coroutines) reached"},
    503: {"model": ErrorResponse, "description": "Memory pool exhausted or server shutting down"},
    507: {"model": ErrorResponse, "description": "The session journal cannot be written (disk full)"},
}
