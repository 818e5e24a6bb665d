"""/metrics agrees with what the engine ran (steps, tokens, works) and its memory (real loopback server)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support import running_server, tiny_engine

from cothink.observability import EngineMetrics
from cothink.observability.metrics import parse_exposition
from cothink.server import ServerSettings


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with running_server(engine, ServerSettings(model_name="tiny")) as srv:
        srv.engine = engine
        yield srv


def scrape(url: str) -> dict:
    return parse_exposition(httpx.get(url + "/metrics").text)


def snapshot(srv) -> dict:
    def read():
        stats = srv.engine.stats.values()
        return {
            "steps": srv.engine.steps,
            "written": sum(s.tokens_written for s in stats),
            "read": sum(s.tokens_read for s in stats),
            "items": sum(len(r.items) for r in srv.engine.timeline),
            "memory": srv.engine.memory(),
        }

    return srv.call(read)


def test_metrics_match_the_engine(server):
    before, m0 = snapshot(server), scrape(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        a = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "alpha beta gamma"}).json()["id"]
        b = http.post(f"/v1/sessions/{sid}/blocks", json={}).json()["id"]
        for _ in range(2):
            r = http.post(
                f"/v1/sessions/{sid}/generate",
                json={"view": [a, b], "max_tokens": 4, "stream": False, "priority": "interactive"},
            )
            assert r.status_code == 200
        r = http.post(f"/v1/sessions/{sid}/probe", json={"view": [a, b], "question": " ok? Answer:"})
        assert r.status_code == 200
        r = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200
        after, m1 = snapshot(server), scrape(server.url)

    def delta(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    steps = after["steps"] - before["steps"]
    assert steps > 0
    assert delta("cothink_steps_total") == steps
    assert delta("cothink_step_seconds_count") == steps
    assert delta("cothink_step_items_sum") == after["items"] - before["items"]
    written = after["written"] - before["written"]
    assert delta("cothink_prefill_tokens_total") + delta("cothink_decode_tokens_total") == written
    assert delta("cothink_step_tokens_sum") == written
    assert delta("cothink_view_tokens_read_total") == after["read"] - before["read"]
    # 2 session generations (4 tokens each) + 1 chat generation: decode tokens, TTFT per generation
    assert delta("cothink_decode_tokens_total") >= 8
    assert delta('cothink_time_to_first_token_seconds_count{priority="interactive"}') == 3
    assert delta('cothink_probe_seconds_count{priority="interactive"}') == 1
    # works: 1 extend (block a) + 2 generations + 1 probe (session) + 1 extend + 1 generation (chat)
    assert delta('cothink_works_finished_total{outcome="done",work="extend"}') == 2
    assert (
        delta('cothink_works_finished_total{outcome="length",work="generate"}')
        + delta('cothink_works_finished_total{outcome="stop",work="generate"}')
        == 3
    )
    assert delta('cothink_works_finished_total{outcome="done",work="probe"}') == 1
    queue_waits = sum(v for k, v in m1.items() if k.startswith("cothink_queue_wait_seconds_count")) - sum(
        v for k, v in m0.items() if k.startswith("cothink_queue_wait_seconds_count")
    )
    assert queue_waits == 6  # every work was scheduled once
    assert m1['cothink_works_active{work="generate"}'] == 0
    assert m1["cothink_live_coroutines"] == 0
    # memory gauges are read from engine.memory() at scrape time
    mem = after["memory"]
    assert m1["cothink_kv_pages_used"] == mem.used_pages and m1["cothink_kv_pages_free"] == mem.free_pages
    assert m1["cothink_kv_bytes_used"] == mem.kv_bytes_used and m1["cothink_live_blocks"] == mem.live_blocks
    assert m1["cothink_kv_pages_total"] == mem.used_pages + mem.free_pages
    assert m1["cothink_sessions"] == 1
    assert (
        m1[
            'cothink_http_requests_total{method="POST",route="/v1/sessions/{session_id}/generate",status="200"}'
        ]
        >= 2
    )
    assert all(k.startswith("cothink_") for k in m1)  # a dedicated registry: nothing else


def test_engine_metrics_without_a_server():
    engine = tiny_engine()
    metrics = EngineMetrics(engine).attach()

    async def main():
        async with engine:
            blk = engine.block()
            await engine.extend(blk, token_ids=list(range(1, 40)))
            await engine.generate([blk], max_tokens=3, stop_at_eos=False).collect()

    asyncio.run(main())
    values = parse_exposition(metrics.exposition().decode())
    assert values["cothink_steps_total"] == engine.steps
    assert values["cothink_prefill_tokens_total"] == 39
    assert values["cothink_decode_tokens_total"] + values["cothink_prefill_tokens_total"] == sum(
        s.tokens_written for s in engine.stats.values()
    )
    assert values['cothink_time_to_first_token_seconds_count{priority="background"}'] == 1
    metrics.detach()
    assert metrics.on_step not in engine.step_listeners
