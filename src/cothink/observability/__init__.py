"""Observability: structured logs, Prometheus metrics, OpenTelemetry spans and step timelines."""

from cothink.observability.logs import bind_owner, forget_owner, session_var, setup_logging
from cothink.observability.metrics import EngineMetrics
from cothink.observability.timeline import chrome_trace, render_timeline_png, write_chrome_trace
from cothink.observability.tracing import WorkTracer, configure_tracing, instrument

__all__ = [
    "EngineMetrics",
    "WorkTracer",
    "bind_owner",
    "chrome_trace",
    "configure_tracing",
    "forget_owner",
    "instrument",
    "render_timeline_png",
    "session_var",
    "setup_logging",
    "write_chrome_trace",
]
