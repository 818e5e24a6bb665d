"""OpenTelemetry spans for extend / generate / probe, from the library (instrument) and the server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import running_server, tiny_engine

from cothink.observability import configure_tracing, instrument
from cothink.server import ServerSettings


def provider_and_exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_instrument_engine_spans_each_work():
    engine = tiny_engine()
    provider, exporter = provider_and_exporter()
    tracer = instrument(engine, provider)
    assert instrument(engine, provider) is tracer  # idempotent

    async def main():
        async with engine:
            blk = engine.block("notes")
            await engine.extend(blk, token_ids=list(range(1, 20)), name="writer")
            await engine.generate([blk], max_tokens=3, stop_at_eos=False, name="writer").collect()
            await engine.probe([blk], [3, 4], ("a", "b"), name="judge")

    asyncio.run(main())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"cothink.extend", "cothink.generate", "cothink.probe"}
    gen = spans["cothink.generate"]
    assert gen.attributes["cothink.coroutine"] == "writer" and gen.attributes["cothink.block"] == "notes"
    assert gen.attributes["cothink.outcome"] == "length"
    assert [e.name for e in gen.events] == ["scheduled", "first_token"]
    assert gen.end_time > gen.start_time
    assert spans["cothink.probe"].attributes["cothink.coroutine"] == "judge"
    assert spans["cothink.probe"].attributes["cothink.priority"] == "interactive"
    assert spans["cothink.extend"].attributes["cothink.outcome"] == "done"
    engine.work_listeners.remove(tracer)


def test_server_request_spans_parent_the_work_spans():
    engine = tiny_engine()
    provider, exporter = provider_and_exporter()
    with running_server(engine, ServerSettings(model_name="tiny"), tracer_provider=provider) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            sid = http.post("/v1/sessions").json()["id"]
            blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "hello world"}).json()["id"]
            out = http.post(f"/v1/sessions/{sid}/blocks").json()["id"]
            gen = http.post(
                f"/v1/sessions/{sid}/generate", json={"view": [blk, out], "max_tokens": 3, "stream": False}
            ).json()
            http.post(f"/v1/sessions/{sid}/probe", json={"view": [blk], "question": " ok? Answer:"})
            http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            )
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    request = next(
        s
        for s in by_name["cothink.session.generate"]
        if s.attributes["cothink.coroutine"] == gen["coroutine"]
    )
    work = next(
        s for s in by_name["cothink.generate"] if s.attributes["cothink.coroutine"] == gen["coroutine"]
    )
    assert work.parent is not None and work.parent.span_id == request.context.span_id
    assert work.context.trace_id == request.context.trace_id
    assert work.attributes["cothink.session"] == sid and request.attributes["cothink.session"] == sid
    assert (
        request.attributes["cothink.block"] == out and request.attributes["cothink.finish_reason"] == "length"
    )
    assert request.attributes["cothink.completion_tokens"] == 3
    assert len(by_name["cothink.session.extend"]) == 1 and len(by_name["cothink.session.probe"]) == 1
    extend = by_name["cothink.extend"][0]
    assert extend.parent.span_id == by_name["cothink.session.extend"][0].context.span_id
    probe = by_name["cothink.probe"][0]
    assert probe.parent.span_id == by_name["cothink.session.probe"][0].context.span_id
    chat = by_name["cothink.openai.request"][0]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == chat.context.span_id]
    assert {s.name for s in children} == {"cothink.extend", "cothink.generate"}
    # the server removed its listener at shutdown
    assert not any(type(x).__name__ == "WorkTracer" for x in engine.work_listeners)


@pytest.mark.parametrize("value", ["none", "bogus"])
def test_configure_tracing_off(value, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", value)
    assert configure_tracing() is None
