"""What the server's routes share: the engine, settings, sessions, metrics, tracer and live generations."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from fastapi import Request, WebSocket
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cothink.errors import CothinkError
from cothink.observability.metrics import EngineMetrics
from cothink.observability.tracing import WorkTracer, get_tracer, instrument
from cothink.server.errors import APIError, from_exception
from cothink.server.sessions import SessionManager
from cothink.server.settings import ServerSettings

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine, Generation

log = logging.getLogger("cothink.server")
T = TypeVar("T")


class ServerState:
    def __init__(
        self, engine: Engine, settings: ServerSettings, tracer_provider: trace.TracerProvider | None = None
    ):
        self.engine, self.settings = engine, settings
        self.sessions = SessionManager(engine, settings)
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(engine, self.registry)  # attached while the app runs
        self.work_tracer: WorkTracer | None = None
        self.owns_tracer = False
        self.tracer = get_tracer(tracer_provider)
        self.tracer_provider = tracer_provider
        self.live: set[Generation] = set()  # generations of OpenAI requests (sessions track their own)
        self.draining = False
        self.started_engine = False
        r = self.registry
        self.http_requests = Counter(
            "cothink_http_requests",
            "HTTP requests, by route and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.http_seconds = Histogram(
            "cothink_http_request_seconds",
            "HTTP request duration (streams: until the last byte)",
            ["method", "route"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.sessions_gauge = Gauge("cothink_sessions", "Live sessions", registry=r)
        self.sessions_gauge.set_function(lambda: len(self.sessions.sessions))
        self.streams_gauge = Gauge("cothink_streams_active", "Open SSE streams and WebSockets", registry=r)
        vocab = getattr(getattr(engine.runner, "config", None), "vocab_size", None)
        self.vocab_size: int | None = vocab

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- engine calls -------------------------------------------------------------------------
    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a synchronous engine call; cothink and value errors become 4xx APIErrors."""
        self.check_open()
        try:
            return fn(*args, **kwargs)
        except (CothinkError, ValueError, TypeError) as exc:
            raise from_exception(exc) from exc

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await an engine future; its cancellation (shutdown, released block) becomes a 4xx/503 APIError."""
        try:
            return await awaitable
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we are being cancelled ourselves
            if self.draining:
                raise APIError(
                    503, "the server is shutting down", "server_overloaded", "shutting_down"
                ) from None
            raise APIError(
                409,
                "the operation was cancelled: its block was released or its writer cancelled",
                "conflict_error",
                "cancelled",
            ) from None
        except (CothinkError, ValueError, TypeError) as exc:
            raise from_exception(exc) from exc

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_overloaded", "shutting_down")
        if not self.engine.running:
            raise APIError(503, "the engine is not running", "server_overloaded", "engine_closed")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            raise APIError(
                400,
                f"token ids must be in [0, {self.vocab_size})",
                "invalid_request_error",
                "invalid_token_id",
                param,
            )

    def encode(self, text: str, param: str = "text") -> list[int]:
        if self.tokenizer is None:
            raise APIError(
                400,
                "this model has no tokenizer: send token_ids",
                "invalid_request_error",
                "no_tokenizer",
                param,
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.metrics.attach()
        existing = [x for x in self.engine.work_listeners if isinstance(x, WorkTracer)]
        self.owns_tracer = not existing  # a library user's instrument() stays theirs
        self.work_tracer = existing[0] if existing else instrument(self.engine, self.tracer_provider)
        if not self.engine.running:
            await self.engine.start()
            self.started_engine = True

    async def drain(self) -> None:
        """Stop taking work; end running generations (finish reason 'cancelled') and stop the engine."""
        if self.draining:
            return
        self.draining = True
        cancelled = self.sessions.cancel_all()
        for gen in list(self.live):
            gen.cancel()
            cancelled += 1
        if cancelled:
            log.info("shutting down: cancelled %d running generations", cancelled)
        await asyncio.sleep(0)  # let streams write their last events
        if self.started_engine:
            await self.engine.stop()

    async def close(self) -> None:
        await self.drain()
        self.sessions.close_all()
        if self.owns_tracer and self.work_tracer is not None:
            self.work_tracer.close()
            if self.work_tracer in self.engine.work_listeners:
                self.engine.work_listeners.remove(self.work_tracer)
        self.metrics.detach()


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency (async, so it costs no thread hop)."""
    return request.app.state.cothink


def get_ws_state(websocket: WebSocket) -> ServerState:
    return websocket.app.state.cothink


def principal(request: Request | WebSocket) -> str:
    return request.scope.get("cothink.principal", "anonymous")
