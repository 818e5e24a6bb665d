"""Prometheus metrics for an Engine, fed by its step and work listeners.

    metrics = EngineMetrics(engine)            # a dedicated CollectorRegistry unless one is given
    metrics.attach()
    text = metrics.exposition()                # Prometheus text format

Every name starts with ``cothink_``. Memory gauges are read from ``engine.memory()`` at scrape time;
``cothink_stream_events_dropped_total{agent}`` counts what agents' bounded queues dropped
(`count_dropped_events`).
"""

from __future__ import annotations

from collections import Counter as _Tally
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine, StepRecord, WorkEvent

__all__ = ["CONTENT_TYPE", "EngineMetrics", "count_dropped_events", "dropped_events"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PREFILL_KINDS = ("extend", "probe")  # step items that read input; "generate" items are decode


class _MemoryCollector(Collector):
    """KV pool and block gauges, read from engine.memory() when scraped."""

    def __init__(self, engine: Engine, metrics: EngineMetrics):
        self.engine, self.metrics = engine, metrics

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []  # computed at collect time; no fixed description needed

    def collect(self) -> Iterable[GaugeMetricFamily]:
        m = self.engine.memory()
        total = m.used_pages + m.free_pages
        pool = getattr(getattr(getattr(self.engine, "runner", None), "store", None), "pool", None)
        bytes_per_page = getattr(pool, "bytes_per_page", 0) or (
            m.kv_bytes_used // m.used_pages if m.used_pages else 0
        )
        values = [
            ("cothink_kv_pages_used", "KV pool pages in use", m.used_pages),
            ("cothink_kv_pages_free", "KV pool pages free", m.free_pages),
            ("cothink_kv_pages_total", "KV pool pages in all", total),
            ("cothink_kv_page_size_tokens", "Tokens per KV page", m.page_size),
            ("cothink_kv_bytes_used", "Bytes of KV pool pages in use", m.kv_bytes_used),
            ("cothink_kv_bytes_total", "Bytes of the whole KV pool", bytes_per_page * total),
            (
                "cothink_linear_state_bytes",
                "Bytes held by linear-attention records and summaries",
                m.linear_bytes,
            ),
            ("cothink_live_blocks", "Blocks alive in memory (including scratch blocks)", m.live_blocks),
            # the memory budget's accounting (docs/runtime.md, "Memory"); shared bytes counted once
            (
                "cothink_linear_bytes_used",
                "Bytes of Gated DeltaNet records, summaries and sealed state in memory",
                m.linear_bytes_used,
            ),
            (
                "cothink_total_bytes_used",
                "Block memory in use: KV pages plus linear records (what memory_budget bounds)",
                m.total_bytes_used,
            ),
            ("cothink_spilled_bytes", "Block memory spilled to disk (not resident)", m.spilled_bytes),
            ("cothink_sealed_blocks", "Sealed (immutable) blocks", m.sealed_blocks),
            ("cothink_spilled_blocks", "Blocks spilled to disk", m.spilled_blocks),
            ("cothink_kv_bytes_per_token", "KV bytes of one token (attention layers)", m.kv_bytes_per_token),
            (
                "cothink_linear_bytes_per_token",
                "Gated DeltaNet record bytes of one token in an unsealed block (all linear layers)",
                m.linear_bytes_per_token,
            ),
            (
                "cothink_live_coroutines",
                "Coroutines (by name) with a running work",
                self.metrics.live_coroutines,
            ),
        ]
        if m.budget_bytes is not None:  # no sample without a budget (only the KV pool bounds memory)
            values.append(("cothink_memory_budget_bytes", "The engine's memory_budget", m.budget_bytes))
        for name, doc, value in values:
            yield GaugeMetricFamily(name, doc, value=value)


# Events agents dropped from their bounded intake queues (drop-oldest under a storm), per agent name,
# for the whole process: agents count here and every EngineMetrics registry (the server's /metrics)
# exports the tally. Kept as a plain tally, not a prometheus Counter, so that it needs no registry.
_DROPPED_EVENTS: _Tally[str] = _Tally()


def count_dropped_events(agent: str, n: int = 1) -> None:
    """Record that agent `agent` (its name; "" for unnamed agents) dropped `n` stale events."""
    _DROPPED_EVENTS[agent] += n


def dropped_events(agent: str) -> int:
    return _DROPPED_EVENTS[agent]


class _AgentCollector(Collector):
    def describe(self) -> Iterable[CounterMetricFamily]:
        return []

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            "cothink_stream_events_dropped",
            "Events agents dropped from a full intake queue (the oldest first), by agent name",
            labels=["agent"],
        )
        for agent, n in sorted(_DROPPED_EVENTS.items()):
            family.add_metric([agent], n)
        yield family


class EngineMetrics:
    """Step time, batch sizes, token counters, queue wait, TTFT, probe latency and memory of one Engine."""

    def __init__(self, engine: Engine, registry: CollectorRegistry | None = None):
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "cothink_step_seconds", "Duration of one engine step (forward pass)", buckets=_LATENCY, registry=r
        )
        self.steps = Counter("cothink_steps", "Engine steps (forward passes) run", registry=r)
        self.step_items = Histogram(
            "cothink_step_items", "Step items (one per scheduled work) per step", buckets=_COUNTS, registry=r
        )
        self.step_tokens = Histogram(
            "cothink_step_tokens", "Tokens written per step", buckets=_TOKENS, registry=r
        )
        self.prefill_tokens = Counter(
            "cothink_prefill_tokens", "Input tokens written (extend and probe items)", registry=r
        )
        self.decode_tokens = Counter("cothink_decode_tokens", "Tokens written by generations", registry=r)
        self.item_tokens = Counter(
            "cothink_step_item_tokens",
            "Tokens written, by work kind and priority",
            ["kind", "priority"],
            registry=r,
        )
        self.view_tokens = Counter(
            "cothink_view_tokens_read", "View positions read by step items", registry=r
        )
        self.queue_wait = Histogram(
            "cothink_queue_wait_seconds",
            "Submit to first scheduled step, per work",
            ["priority", "work"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "cothink_time_to_first_token_seconds",
            "Submit to first generated token",
            ["priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.probe_seconds = Histogram(
            "cothink_probe_seconds",
            "Probe latency, submit to answer",
            ["priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.work_seconds = Histogram(
            "cothink_work_seconds",
            "Work duration, submit to finish",
            ["work", "priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.works_submitted = Counter(
            "cothink_works_submitted", "Works submitted", ["work", "priority"], registry=r
        )
        self.works_finished = Counter(
            "cothink_works_finished", "Works finished, by outcome", ["work", "outcome"], registry=r
        )
        self.works_active = Gauge(
            "cothink_works_active", "Works submitted and not finished", ["work"], registry=r
        )
        self._active_names: _Tally[str] = _Tally()
        r.register(_MemoryCollector(engine, self))
        r.register(_AgentCollector())
        self._attached = False

    @property
    def live_coroutines(self) -> int:
        return len(self._active_names)

    # ---- listeners ----------------------------------------------------------------------------
    def attach(self) -> EngineMetrics:
        if not self._attached:
            self.engine.step_listeners.append(self.on_step)
            self.engine.work_listeners.append(self.on_work)
            self._attached = True
        return self

    def detach(self) -> None:
        if self._attached:
            self.engine.step_listeners.remove(self.on_step)
            self.engine.work_listeners.remove(self.on_work)
            self._attached = False

    def on_step(self, record: StepRecord) -> None:
        self.steps.inc()
        self.step_seconds.observe(record.end - record.start)
        self.step_items.observe(len(record.items))
        self.step_tokens.observe(record.tokens)
        prefill = decode = read = 0
        for item in record.items:
            if item.kind == "generate":
                decode += item.tokens
            else:
                prefill += item.tokens
            read += item.view_tokens
            self.item_tokens.labels(item.kind, item.priority).inc(item.tokens)
        if prefill:
            self.prefill_tokens.inc(prefill)
        if decode:
            self.decode_tokens.inc(decode)
        self.view_tokens.inc(read)

    def on_work(self, event: WorkEvent) -> None:
        if event.event == "submit":
            self.works_submitted.labels(event.work, event.priority).inc()
            self.works_active.labels(event.work).inc()
            self._active_names[event.coroutine] += 1
        elif event.event == "scheduled":
            self.queue_wait.labels(event.priority, event.work).observe(event.value)
        elif event.event == "first_token":
            self.ttft.labels(event.priority).observe(event.value)
        elif event.event == "finish":
            self.works_active.labels(event.work).dec()
            self._active_names[event.coroutine] -= 1
            if self._active_names[event.coroutine] <= 0:
                del self._active_names[event.coroutine]
            self.works_finished.labels(event.work, event.detail or "done").inc()
            self.work_seconds.labels(event.work, event.priority).observe(event.value)
            if event.work == "probe" and event.detail == "done":
                self.probe_seconds.labels(event.priority).observe(event.value)

    # ---- exposition ---------------------------------------------------------------------------
    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def parse_exposition(text: str) -> dict[str, Any]:
    """{sample name with labels: value} from Prometheus text format (for tests and quick checks)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
