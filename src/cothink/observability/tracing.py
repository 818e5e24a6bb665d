"""OpenTelemetry spans for coroutine operations (extend, generate, probe).

`instrument(engine)` opens a span ``cothink.<work>`` when a work is submitted and ends it when the work
finishes, from the engine's work events: the span starts in the caller's context (so it nests under the
caller's current span, e.g. an HTTP request), records ``scheduled`` and ``first_token`` events, and carries
the coroutine, block, priority, queue wait and outcome as attributes.

Spans go nowhere unless an OpenTelemetry SDK tracer provider is set (globally or passed in):
``configure_tracing()`` installs one from ``OTEL_TRACES_EXPORTER`` (``console`` or ``otlp``); tests pass a
provider with an in-memory exporter. Without one, every call here is a cheap no-op.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Any, Callable

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from cothink.observability.logs import session_var

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine, WorkEvent

__all__ = ["WorkTracer", "configure_tracing", "get_tracer", "instrument"]

log = logging.getLogger("cothink.observability")
OK_OUTCOMES = frozenset({"done", "stop", "length", "cancelled"})


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    from cothink import __version__

    return trace.get_tracer("cothink", __version__, tracer_provider=tracer_provider)


def configure_tracing(exporter: str | None = None, service_name: str | None = None):
    """Install a global SDK TracerProvider exporting to `exporter` ('console', 'otlp' or 'none').

    Defaults to the OTEL_TRACES_EXPORTER environment variable; returns the provider, or None when
    tracing stays off. Call the provider's shutdown() at exit to flush (the server does).
    """
    exporter = (exporter or os.environ.get("OTEL_TRACES_EXPORTER") or "none").strip().lower()
    if exporter in ("", "none"):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter == "console":
        span_exporter: Any = ConsoleSpanExporter()
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "OTEL_TRACES_EXPORTER=otlp needs opentelemetry-exporter-otlp-proto-http; tracing is off"
            )
            return None
        span_exporter = OTLPSpanExporter()
    else:
        log.warning("unknown OTEL_TRACES_EXPORTER %r (use console, otlp or none); tracing is off", exporter)
        return None
    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "cothink"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    return provider


class WorkTracer:
    """A work listener that turns each work's submit..finish into a span."""

    def __init__(
        self,
        engine: Engine,
        tracer_provider: trace.TracerProvider | None = None,
        attributes: Callable[[WorkEvent], dict[str, Any]] | None = None,
    ):
        self.engine = engine
        self.tracer = get_tracer(tracer_provider)
        self.attributes = attributes
        self._open: dict[tuple[str, str, str], deque[Span]] = defaultdict(deque)
        # perf_counter seconds -> epoch nanoseconds
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def __call__(self, event: WorkEvent) -> None:
        key = (event.coroutine, event.work, event.block)
        if event.event == "submit":
            attrs: dict[str, Any] = {
                "cothink.coroutine": event.coroutine,
                "cothink.block": event.block,
                "cothink.work": event.work,
                "cothink.priority": event.priority,
            }
            session = session_var.get()
            if session:
                attrs["cothink.session"] = session
            if self.attributes is not None:
                attrs.update(self.attributes(event))
            span = self.tracer.start_span(
                f"cothink.{event.work}", start_time=self._ns(event.time), attributes=attrs
            )
            self._open[key].append(span)
            return
        spans = self._open.get(key)
        if not spans:
            return
        if event.event == "scheduled":
            spans[0].set_attribute("cothink.queue_wait_s", event.value)
            spans[0].add_event("scheduled", {"queue_wait_s": event.value}, timestamp=self._ns(event.time))
        elif event.event == "first_token":
            spans[0].set_attribute("cothink.ttft_s", event.value)
            spans[0].add_event("first_token", {"ttft_s": event.value}, timestamp=self._ns(event.time))
        elif event.event == "finish":
            span = spans.popleft()
            if not spans:
                del self._open[key]
            span.set_attribute("cothink.outcome", event.detail)
            span.set_attribute("cothink.duration_s", event.value)
            if event.detail and event.detail not in OK_OUTCOMES:
                span.set_status(Status(StatusCode.ERROR, event.detail))
            span.end(end_time=self._ns(event.time))

    def close(self) -> None:
        """End spans still open (e.g. at shutdown)."""
        for spans in self._open.values():
            for span in spans:
                span.set_attribute("cothink.outcome", "unfinished")
                span.end()
        self._open.clear()


def instrument(engine: Engine, tracer_provider: trace.TracerProvider | None = None) -> WorkTracer:
    """Emit a span per extend, generate and probe of `engine` (idempotent: returns the same tracer)."""
    for listener in engine.work_listeners:
        if isinstance(listener, WorkTracer):
            return listener
    tracer = WorkTracer(engine, tracer_provider)
    engine.work_listeners.append(tracer)
    return tracer
