"""What the server's routes share: the engine, settings, sessions, metrics, tracer and live generations."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from fastapi import Request, WebSocket
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cothink.errors import CothinkError
from cothink.observability.metrics import EngineMetrics
from cothink.observability.tracing import WorkTracer, get_tracer, instrument
from cothink.server.errors import APIError, from_exception
from cothink.server.journal import open_journal
from cothink.server.prefix_cache import PrefixCache
from cothink.server.quota import MemoryLedger, PoolGeometry
from cothink.server.sessions import SessionManager
from cothink.server.snapshots import SnapshotStore
from cothink.server.settings import ServerSettings

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine, Generation
    from cothink.server.recovery import RecoveryProgress
    from cothink.structured import GrammarCompiler

log = logging.getLogger("cothink.server")
T = TypeVar("T")


class ServerState:
    def __init__(
        self, engine: Engine, settings: ServerSettings, tracer_provider: trace.TracerProvider | None = None
    ):
        settings.check()
        self.engine, self.settings = engine, settings
        g = pool_geometry(engine)
        self.prefix_cache = PrefixCache(engine, int(g.total_pages * settings.prefix_cache_share), g.page_size)
        # the keys' shares add up to at most the pool; the prefix cache gives way to what they promise
        self.ledger = MemoryLedger(
            g,
            int(g.total_pages * settings.memory_share()),
            settings.session_max_tokens,
            make_room=self.prefix_cache.shrink_to,
        )
        self.journal = open_journal(settings)
        self.sessions = SessionManager(engine, settings, self.ledger, self.journal)
        self.recovery: RecoveryProgress | None = None  # set while (and after) journals are replayed
        self.journal_tasks: list[asyncio.Task] = []
        self.snapshots = SnapshotStore(
            snapshot_root(settings),
            settings.key_max_snapshots,
            settings.key_max_snapshot_bytes,
            settings.snapshot_ttl_s,
        )
        # coroutine name -> owner (key fingerprint; a session id without keys), for /v1/timeline
        self.owners: OrderedDict[str, str] = OrderedDict()
        self.max_token_chars: int | None = None  # longest token text: bounds tokens from below by length
        self.max_context: int | None = getattr(engine, "max_context", None)
        self.reaper: asyncio.Task | None = None
        self.grammars: GrammarCompiler | None = None  # JSON schemas and tools -> token constraints
        self.warming: asyncio.Task | None = None
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
        cache = self.prefix_cache
        Gauge(
            "cothink_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache", registry=r
        ).set_function(lambda: cache.hit_tokens)
        Gauge(
            "cothink_prefix_cache_miss_tokens", "Prompt tokens prefilled (not found in the cache)", registry=r
        ).set_function(lambda: cache.miss_tokens)
        Gauge("cothink_prefix_cache_entries", "Cached prompt prefixes", registry=r).set_function(
            lambda: len(cache.entries)
        )
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

    def check_text_size(self, text: str, param: str, limit: int | None = None) -> None:
        """Refuse, before tokenizing, a text that must hold more tokens than `limit` (default: the
        model's context): every token covers at most `max_token_chars` characters."""
        limit = limit if limit is not None else self.max_context
        if limit is None or not self.max_token_chars:
            return
        at_least = math.ceil(len(text) / self.max_token_chars)
        if at_least > limit:
            raise APIError(
                400,
                f"{param} holds {len(text)} characters: at least {at_least} tokens, more than the "
                f"{limit} this model's context allows",
                "invalid_request_error",
                "context_length_exceeded",
                param,
            )

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a CPU-bound call (tokenizing, rendering a chat template) in a worker thread when its input
        is large, so the event loop (and every other client) never waits for it."""
        if size <= self.settings.tokenize_inline_chars:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def encode(self, text: str, param: str = "text", special: bool = False) -> list[int]:
        """Tokenize `text` (size checked first, large texts off the event loop)."""
        if self.tokenizer is None:
            raise APIError(
                400,
                "this model has no tokenizer: send token_ids",
                "invalid_request_error",
                "no_tokenizer",
                param,
            )
        self.check_text_size(text, param)
        try:
            ids = await self.off_loop(len(text), self.tokenizer.encode, text, add_special_tokens=special)
        except Exception as exc:
            err = from_exception(exc)
            err.param = err.param or param
            raise err from None
        return list(ids)

    def own(self, name: str, owner: str) -> None:
        """Record who started a coroutine (for /v1/timeline); bounded, oldest forgotten first."""
        self.owners[name] = owner
        while len(self.owners) > 100_000:
            self.owners.popitem(last=False)

    def check_context(self, prompt_tokens: int, max_tokens: int, param: str = "max_tokens") -> None:
        """A prompt plus max_tokens beyond the context is a 400, not a generation silently cut short."""
        if self.max_context is not None and prompt_tokens + max_tokens > self.max_context:
            raise APIError(
                400,
                f"this model's context is {self.max_context} tokens; the request needs "
                f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt + {max_tokens} max_tokens)",
                "invalid_request_error",
                "context_length_exceeded",
                param,
            )

    def memory(self) -> dict[str, Any]:
        """The pool as /health reports it."""
        stats = self.engine.memory()
        g = self.ledger.geometry
        used_share = stats.used_pages / g.total_pages if g.total_pages else 0.0
        return {
            "total_pages": g.total_pages,
            "used_pages": stats.used_pages,
            "free_pages": stats.free_pages,
            "reserved_pages": self.ledger.usage().pages,
            "page_size": g.page_size,
            "bytes_per_page": g.bytes_per_page,
            "used_share": round(used_share, 4),
            "pressure": used_share >= self.settings.memory_pressure,
        }

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.tokenizer is not None and self.max_token_chars is None:
            self.max_token_chars = await asyncio.to_thread(longest_token_chars, self.tokenizer)
        if self.grammars is None and self.tokenizer is not None:
            from cothink.structured import GrammarCompiler

            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            # the tokenizer table for constrained decoding: built off the loop, before the first request
            self.warming = asyncio.create_task(asyncio.to_thread(self.grammars.warm))
        if self.reaper is None and self.settings.session_idle_s is not None:
            self.reaper = asyncio.create_task(self._reap(), name="cothink-session-reaper")
        self.metrics.attach()
        existing = [x for x in self.engine.work_listeners if isinstance(x, WorkTracer)]
        self.owns_tracer = not existing  # a library user's instrument() stays theirs
        self.work_tracer = existing[0] if existing else instrument(self.engine, self.tracer_provider)
        if not self.engine.running:
            await self.engine.start()
            self.started_engine = True
        self.start_journal()

    def start_journal(self) -> None:
        """Replay the journal directory in the background (only /health answers until it is done),
        then keep journaling; fsync on the configured interval."""
        from cothink.server.journal import FileJournal
        from cothink.server.recovery import RecoveryProgress, recover

        journal = self.journal
        if not isinstance(journal, FileJournal) or self.journal_tasks:
            return
        journal.attach(self.engine, self.sessions.sessions)
        self.recovery = RecoveryProgress()
        self.journal_tasks = [
            asyncio.create_task(recover(self, journal, self.recovery), name="cothink-journal-recovery"),
            asyncio.create_task(journal.run(), name="cothink-journal-sync"),
        ]

    @property
    def recovering(self) -> bool:
        return self.recovery is not None and self.recovery.running

    async def drain(self) -> None:
        """Stop taking work; end running generations (finish reason 'cancelled') and stop the engine."""
        if self.draining:
            return
        self.draining = True
        if self.reaper is not None:
            self.reaper.cancel()
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
        for task in self.journal_tasks:
            task.cancel()
        self.sessions.close_all()
        self.journal.close()
        self.prefix_cache.clear()
        if self.owns_tracer and self.work_tracer is not None:
            self.work_tracer.close()
            if self.work_tracer in self.engine.work_listeners:
                self.engine.work_listeners.remove(self.work_tracer)
        self.metrics.detach()


    async def _reap(self) -> None:
        """Delete idle sessions and release idle blocks (settings.session_idle_s / block_idle_s)."""
        idle = min(x for x in (self.settings.session_idle_s, self.settings.block_expiry_s()) if x is not None)
        interval = min(max(idle / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                expired = self.sessions.expire(time.monotonic())
                if expired:
                    log.info("expired %d idle sessions or blocks", expired)
            except Exception:  # never let the reaper die
                log.exception("session expiry failed")


def snapshot_root(settings: ServerSettings) -> Path:
    if settings.snapshot_dir is not None:
        return Path(settings.snapshot_dir).expanduser()
    from cothink.models.hub import cache_dir

    return cache_dir() / "snapshots"


def pool_geometry(engine: Engine) -> PoolGeometry:
    """Pool size, page size and bytes per page from `engine.memory()` (bytes per page from the model's
    shape while the pool is empty)."""
    stats = engine.memory()
    total = stats.used_pages + stats.free_pages
    if stats.used_pages:
        per_page = stats.kv_bytes_used // stats.used_pages
    else:
        runner = getattr(engine, "runner", None)
        cfg = getattr(runner, "config", None)
        try:
            layers = len(cfg.attention_layers)
            elem = torch_element_size(getattr(runner, "dtype", None))
            per_page = cfg.kv_bytes_per_token(elem) * stats.page_size if layers else 0
        except (AttributeError, TypeError):
            per_page = 0
    return PoolGeometry(total, stats.page_size, per_page)


def torch_element_size(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype or torch.float32).element_size()


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest token's text (byte-level vocabularies: bytes)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=0)


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency (async, so it costs no thread hop)."""
    return request.app.state.cothink


def get_ws_state(websocket: WebSocket) -> ServerState:
    return websocket.app.state.cothink


def principal(request: Request | WebSocket) -> str:
    return request.scope.get("cothink.principal", "anonymous")
