"""Concurrency: 32 streaming sessions at once while /health stays responsive (real loopback server)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from support import running_server, tiny_engine

from cothink.server import ServerSettings

pytestmark = pytest.mark.slow
SESSIONS = 32
MAX_TOKENS = 8


async def one_session(http: httpx.AsyncClient, i: int) -> dict:
    sid = (await http.post("/v1/sessions", json={"name": f"load-{i}"})).json()["id"]
    prompt = (
        await http.post(f"/v1/sessions/{sid}/blocks", json={"text": f"Story number {i}: once upon"})
    ).json()
    out = (await http.post(f"/v1/sessions/{sid}/blocks", json={})).json()
    events = []
    async with http.stream(
        "POST",
        f"/v1/sessions/{sid}/generate",
        json={
            "view": [prompt["id"], out["id"]],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.8,
            "seed": i,
            "stop_at_eos": False,
        },
    ) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert (await http.delete(f"/v1/sessions/{sid}")).status_code == 200
    return {"events": events}


async def one_chat(http: httpx.AsyncClient, i: int) -> list[str]:
    lines = []
    async with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Hello {i}"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "seed": i,
        },
    ) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
    return lines


async def poll_health(url: str, stop: asyncio.Event, answers: list[tuple[float, float]]) -> None:
    """GET /health until told to stop; records each call's (sent, answered) perf_counter times."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await http.get("/health")
            answers.append((t0, time.perf_counter()))
            assert r.status_code == 200
            await asyncio.sleep(0.02)


def test_32_concurrent_streams_and_health_stays_responsive():
    engine = tiny_engine()
    settings = ServerSettings(model_name="tiny", max_sessions=64)
    with running_server(engine, settings) as srv:
        baseline = srv.call(lambda: engine.memory().live_blocks)

        async def main():
            stop, answers = asyncio.Event(), []
            poller = asyncio.create_task(poll_health(srv.url, stop, answers))
            limits = httpx.Limits(max_connections=SESSIONS + 8)
            async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as http:
                results = await asyncio.gather(
                    *(one_session(http, i) for i in range(SESSIONS)), *(one_chat(http, i) for i in range(4))
                )
            stop.set()
            await poller
            return results, answers

        results, answers = asyncio.run(main())
        sessions, chats = results[:SESSIONS], results[SESSIONS:]
        for r in sessions:
            events = r["events"]
            assert events[0]["type"] == "start"
            assert events[-1]["type"] == "end", events[-1]
            assert events[-1]["finish_reason"] == "length"
            assert len(events[-1]["token_ids"]) == MAX_TOKENS
        for lines in chats:
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        # /health was answered while the streams ran: calls sent and answered between the engine's
        # first and last step (how many depends on the machine's speed; that there is one does not)
        records = srv.call(lambda: list(engine.timeline))
        first, last = records[0].start, records[-1].end
        assert any(first < sent and answered < last for sent, answered in answers), (first, last, answers)
        # every block went back
        srv.call(srv.app.state.cothink.prefix_cache.clear)  # cached prompt prefixes are kept by design
        assert srv.call(lambda: engine.memory().live_blocks) == baseline
        metrics = httpx.get(srv.url + "/metrics").text
        assert "cothink_sessions 0.0" in metrics
