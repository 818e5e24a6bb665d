"""The FastAPI app: OpenAI-compatible routes, the session API, health, metrics and the step timeline.

    app = create_app(engine, ServerSettings(model_name="smollm2", api_keys=("secret",)))

The engine's steps run synchronously on the event loop between awaits, so the app starts the engine
in its lifespan, on the server's own loop. Run it with `cothink.server.runner.serve` (or
`BackgroundServer` in tests): they end running generations before the server waits for connections,
so shutdown never hangs on a stream.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from opentelemetry import trace

from cothink.observability.logs import request_var
from cothink.observability.timeline import render_timeline_png, write_chrome_trace
from cothink.server import events, openai_api, session_api, system_api
from cothink.server.errors import APIError, install_error_handlers
from cothink.server.journal import JournalWriteError, journal_unavailable
from cothink.server.settings import ServerSettings
from cothink.server.state import ServerState

if TYPE_CHECKING:
    pass

log = logging.getLogger("cothink.server")

OPEN_PATHS = frozenset({"/health", *events.CONSOLE_PATHS})  # the console page asks for a key

DESCRIPTION = """\
An HTTP front for one cothink engine: one language model whose coroutines share memory.

* **OpenAI-compatible**: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (streaming over SSE).
  Each request runs in fresh blocks that are released when it ends.
* **Session API** (`/v1/sessions/...`): blocks you create, extend, fork, truncate and delete; generations
  over any view (a list of your blocks), streamed over SSE or run in the background; probes; cancellation.
  A WebSocket at `/v1/sessions/{session_id}/ws` runs the same operations full duplex (send
  `{"type": "generate" | "extend" | "probe" | "cancel", ...}` while tokens stream back).
* Ids are unguessable and scoped: another session or API key gets 404.
* Errors are JSON: `{"error": {"message", "type", "code", "param"}}`.

With an API key configured, every route except `/health` needs `Authorization: Bearer <key>`.
"""


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in (err.headers or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Bearer-key check for every route but /health; records the caller's key fingerprint in the scope."""

    def __init__(self, app, api_keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()):
        self.app = app
        self.keys = [(k.encode(), fingerprint(k)) for k in api_keys]
        self.admins = frozenset(fingerprint(k) for k in admin_keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope["cothink.principal"] = "anonymous"
        if self.keys and scope.get("path") not in OPEN_PATHS:
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            who = None
            if scheme.lower() == b"bearer" and token:
                for key, fp in self.keys:
                    if hmac.compare_digest(token.strip(), key):
                        who = fp
            if who is None:
                if scope["type"] == "websocket":
                    await receive()  # the websocket.connect message
                    await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
                    return
                msg = (
                    "missing API key: send 'Authorization: Bearer <key>'" if not header else "invalid API key"
                )
                return await _send_error(
                    send,
                    APIError(
                        401,
                        msg,
                        "authentication_error",
                        "invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    ),
                )
            scope["cothink.principal"] = who
            scope["cothink.admin"] = who in self.admins
        return await self.app(scope, receive, send)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def allowed_host_names(settings: ServerSettings) -> frozenset[str] | None:
    """Host header names to accept; None accepts any (a non-loopback bind without --allowed-hosts)."""
    if settings.allowed_hosts is not None:
        return frozenset(h.lower() for h in settings.allowed_hosts)
    if _is_loopback(settings.bind_host):
        return frozenset(LOOPBACK_HOSTS) | {settings.bind_host}
    return None


def _host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostOriginMiddleware:
    """DNS-rebinding and cross-site defences: the Host header must name this server (loopback names when
    bound to loopback, unless --allowed-hosts says otherwise) and a browser's Origin must be allowed
    explicitly (--allowed-origins); WebSocket handshakes included."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.hosts = allowed_host_names(settings)
        self.origins = frozenset(o.rstrip("/").lower() for o in settings.allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        problem = None
        if self.hosts is not None:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                problem = ("host_not_allowed", "the Host header does not name this server")
        origin = headers.get(b"origin")
        if problem is None and origin is not None:
            value = origin.decode("latin-1").rstrip("/").lower()
            if value not in self.origins and "*" not in self.origins:
                problem = ("origin_not_allowed", "requests from this browser origin are not allowed")
        if problem is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.close", "code": 1008, "reason": problem[1]})
            return
        return await _send_error(send, APIError(403, problem[1], "permission_error", problem[0]))


class BodyLimitMiddleware:
    """Read request bodies up front and answer 413 above `limit` bytes (with or without Content-Length)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        too_big = APIError(
            413, f"request body exceeds {self.limit} bytes", "invalid_request_error", "body_too_large"
        )
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.limit:
                    return await _send_error(send, too_big)
            except ValueError:
                return await _send_error(send, APIError(400, "bad Content-Length", "invalid_request_error"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await _send_error(send, too_big)
            chunks.append(body)
            if not message.get("more_body"):
                break
        replayed = False
        body = b"".join(chunks)
        if b"json" in dict(scope.get("headers") or []).get(b"content-type", b""):
            body = escape_invalid_utf8(body)

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


_STRAY_BYTE = re.compile("[\udc80-\udcff]")


def escape_invalid_utf8(body: bytes) -> bytes:
    """A JSON body with each byte that is not UTF-8 written as the JSON escape of a lone surrogate
    (\\udcXX). Inside a string the body then parses, and the request models' Unicode check answers
    400 naming that field; anywhere else the body is not JSON (400 `invalid_json`)."""
    try:
        body.decode("utf-8")
        return body
    except UnicodeDecodeError:
        text = body.decode("utf-8", "surrogateescape")
        return _STRAY_BYTE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode("utf-8")


class ObserveMiddleware:
    """Per-request id (x-request-id) in the log context, HTTP request metrics, 503 while draining or
    while sessions are restored from the journal (only /health answers then), and the journal's
    barrier: a session route's response leaves only once the session's journal holds what its memory
    holds (507 otherwise)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        request_id = f"req_{secrets.token_hex(6)}"
        token = request_var.set(request_id)
        start = time.perf_counter()
        status = [0]
        journaled = _journaled_session(self.state, scope)
        replaced = [False]  # the journal refused: the app's own response is dropped

        async def send_wrapped(message):
            if replaced[0]:
                return
            if message["type"] == "http.response.start":
                if journaled is not None:
                    try:
                        self.state.journal.settle(journaled)
                    except JournalWriteError as exc:
                        log.error("session %s: %s", journaled, exc)
                        replaced[0] = True
                        return await _send_error(send, journal_unavailable(exc))
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            if self.state.recovering:
                await _while_recovering(self.state, scope, receive, send_wrapped)
            elif self.state.draining and scope.get("path") not in OPEN_PATHS and scope["type"] == "http":
                shutting = APIError(
                    503,
                    "the server is shutting down",
                    "server_overloaded",
                    "shutting_down",
                    headers={"Connection": "close"},  # the connection ends with this answer
                )
                await _send_error(send_wrapped, shutting)
            else:
                await self.app(scope, receive, send_wrapped)
        finally:
            request_var.reset(token)
            if scope["type"] == "http":
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                method = scope.get("method", "")
                self.state.http_requests.labels(method, path, str(status[0] or 500)).inc()
                self.state.http_seconds.labels(method, path).observe(time.perf_counter() - start)


def _journaled_session(state: ServerState, scope) -> str | None:
    """The session a request's path names, when its changes are journaled."""
    if not state.journal.enabled or scope["type"] != "http":
        return None
    parts = scope.get("path", "").split("/")
    if len(parts) > 3 and parts[1] == "v1" and parts[2] == "sessions" and parts[3].startswith("sess_"):
        return parts[3]
    return None


async def _while_recovering(state: ServerState, scope, receive, send) -> None:
    """Answer a request that arrives while sessions are restored: /health reports the progress,
    everything else is 503 `recovering` (WebSockets are closed with 1013, try again later)."""
    progress = state.recovery.report() if state.recovery is not None else {}
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.close", "code": 1013, "reason": "restoring sessions"})
        return
    if scope.get("path") == "/health":
        body = json.dumps({"status": "recovering", "engine_running": state.engine.running,
                           "recovery": progress}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await _send_error(
        send,
        APIError(
            503,
            f"the server is restoring sessions from its journal ({progress.get('sessions_restored', 0)} "
            f"of {progress.get('sessions_total', 0)} done)",
            "server_overloaded",
            "recovering",
            headers={"Retry-After": "1"},
        ),
    )


def _write_trace(state: ServerState, target: str) -> None:
    path = Path(target)
    json_path = path.with_suffix(".json") if path.suffix.lower() == ".png" else path
    png_path = path if path.suffix.lower() == ".png" else path.with_suffix(".png")
    records = list(state.engine.timeline)
    write_chrome_trace(records, json_path)
    try:
        render_timeline_png(records, png_path)
    except Exception:  # the JSON is the essential part
        log.exception("could not render the timeline PNG")
        return
    log.info("wrote step timeline (%d steps) to %s and %s", len(records), json_path, png_path)


def create_app(
    engine, settings: ServerSettings | None = None, *, tracer_provider: trace.TracerProvider | None = None
) -> FastAPI:
    """A FastAPI app serving `engine`. The app starts the engine in its lifespan (unless already running)
    and stops it at shutdown after ending running generations."""
    settings = settings or ServerSettings()
    state = ServerState(engine, settings, tracer_provider)
    hub = events.EventHub(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        hub.attach()
        log.info("serving model %r", settings.model_name)
        try:
            yield
        finally:
            hub.close()
            await state.close()
            if settings.trace_out:
                _write_trace(state, settings.trace_out)

    from cothink import __version__

    app = FastAPI(
        title="cothink",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_tags=[
            {"name": "openai", "description": "OpenAI-compatible completions"},
            {"name": "sessions", "description": "Sessions, blocks and coroutines"},
            {"name": "system", "description": "Health, metrics and the step timeline"},
        ],
    )
    app.state.cothink = state
    app.state.events = hub
    install_error_handlers(app)

    app.include_router(system_api.router)
    app.include_router(openai_api.router)
    app.include_router(session_api.router)
    app.include_router(events.router)  # /v1/events and the console page at /console

    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, api_keys=settings.keys(), admin_keys=tuple(settings.admin_keys))
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(HostOriginMiddleware, settings=settings)
    app.add_middleware(ObserveMiddleware, state=state)
    return app


def app_state(app: FastAPI) -> ServerState:
    return app.state.cothink
