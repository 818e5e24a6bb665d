"""Step timelines: Chrome trace JSON and PNG from engine.timeline; /v1/timeline; --trace-out at shutdown."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from support import running_server, tiny_engine

from cothink.observability import chrome_trace, render_timeline_png, write_chrome_trace
from cothink.server import ServerSettings


@pytest.fixture(scope="module")
def ran():
    """An engine that ran three coroutines concurrently: a prefill, two generations and a probe."""
    engine = tiny_engine()

    async def main():
        async with engine:
            ctx = engine.block("ctx")
            await engine.extend(ctx, token_ids=list(range(1, 60)), name="reader")
            a, b = engine.block("a"), engine.block("b")
            await asyncio.gather(
                engine.generate([ctx, a], max_tokens=5, stop_at_eos=False, name="thinker").collect(),
                engine.generate([ctx, b], max_tokens=3, stop_at_eos=False, name="narrator").collect(),
                engine.probe([ctx], [5, 6], ("x", "y"), name="prober"),
            )

    asyncio.run(main())
    return engine


def test_chrome_trace_has_a_track_per_coroutine_and_an_event_per_step_item(ran, tmp_path):
    records = list(ran.timeline)
    path = write_chrome_trace(records, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == sum(len(r.items) for r in records)
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(tracks) == {"reader", "thinker", "narrator", "prober"}
    for name, tid in tracks.items():
        mine = [e for e in xs if e["tid"] == tid]
        expected = [i for r in records for i in r.items if i.coroutine == name]
        assert len(mine) == len(expected)
        assert sum(e["args"]["tokens"] for e in mine) == sum(i.tokens for i in expected)
        assert sum(e["args"]["view_tokens"] for e in mine) == sum(i.view_tokens for i in expected)
        assert {e["args"]["kind"] for e in mine} == {i.kind for i in expected}
    assert sum(e["args"]["tokens"] for e in xs if e["args"]["kind"] == "generate") == 5 + 3
    assert sum(e["args"]["tokens"] for e in xs if e["tid"] == tracks["reader"]) == 59
    starts = [e["ts"] for e in xs]
    assert min(starts) == 0 and all(e["dur"] > 0 for e in xs)
    # the two generations shared steps (batched together)
    steps_t = {e["args"]["step"] for e in xs if e["tid"] == tracks["thinker"]}
    steps_n = {e["args"]["step"] for e in xs if e["tid"] == tracks["narrator"]}
    assert steps_t & steps_n


def test_png_timeline(ran, tmp_path):
    path = render_timeline_png(ran.timeline, tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    empty = render_timeline_png([], tmp_path / "empty.png")  # no steps: still a valid picture
    assert empty.read_bytes()[:4] == b"\x89PNG"
    assert chrome_trace([])["traceEvents"][0]["ph"] == "M"


def test_server_timeline_endpoint_and_trace_out(tmp_path):
    engine = tiny_engine()
    out = tmp_path / "serve-trace.json"
    with running_server(engine, ServerSettings(model_name="tiny", trace_out=str(out))) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "a b c", "max_tokens": 3})
            assert r.status_code == 200
            trace = http.get("/v1/timeline").json()
            last = http.get("/v1/timeline", params={"steps": 1}).json()
        items = srv.call(lambda: sum(len(r.items) for r in engine.timeline))
        assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == items
        assert trace["otherData"]["steps"] == srv.call(lambda: len(engine.timeline))
        assert last["otherData"]["steps"] == 1
    saved = json.loads(out.read_text())
    assert len([e for e in saved["traceEvents"] if e["ph"] == "X"]) == sum(
        len(r.items) for r in engine.timeline
    )
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
