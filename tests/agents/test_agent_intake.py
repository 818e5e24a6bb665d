"""Bounded drop-oldest intake of the stream agent and the monitor, counted in Prometheus metrics
(cothink_stream_events_dropped_total{agent}) on a real tiny model."""

from __future__ import annotations

import asyncio

import pytest
from support import tiny_engine

from cothink.agents import Monitor, StreamAgent
from cothink.observability.metrics import EngineMetrics, dropped_events, parse_exposition


async def burst(lines: list[str], fail_after: int | None = None):
    """All at once (no await between items): a storm that arrives faster than any probe."""
    for i, line in enumerate(lines):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("the source broke")
        yield line


def exported(engine, agent: str) -> float:
    samples = parse_exposition(EngineMetrics(engine).exposition().decode())
    return samples.get(f'cothink_stream_events_dropped_total{{agent="{agent}"}}', 0.0)


def test_stream_agent_counts_dropped_events_in_metrics():
    async def main():
        async with tiny_engine() as engine:
            before = dropped_events("burst-stream")
            agent = StreamAgent(
                engine, task="Comment on the log.", event_threshold=1.1, max_pending=2, think_tokens=0,
                name="burst-stream",
            )
            result = await agent.run(burst([f"line {i}" for i in range(20)]))
            return result, dropped_events("burst-stream") - before, exported(engine, "burst-stream")

    result, counted, exposed = asyncio.run(main())
    assert result.events_seen == 20 and result.events_dropped == 18  # the queue holds 2
    assert counted == 18 and exposed >= 18


def test_monitor_bounded_intake_drops_oldest_and_counts():
    lines = [f"cpu {i}%" for i in range(20)]

    async def main(max_pending):
        async with tiny_engine() as engine:
            before = dropped_events("burst-monitor")
            mon = Monitor(
                engine, task="Watch CPU load.", kinds=("spike", "drop"), threshold=1.1, check_every=5,
                max_pending=max_pending, name="burst-monitor",
            )
            result = await mon.run(burst(lines))
            return result, dropped_events("burst-monitor") - before, exported(engine, "burst-monitor")

    # default: pulled one at a time, nothing dropped (the source waits)
    result, counted, _ = asyncio.run(main(None))
    assert result.observations == 20 and result.observations_dropped == 0 and counted == 0
    # a bounded queue of 3 under a burst of 20: the 17 oldest go, the newest 3 are watched
    result, counted, exposed = asyncio.run(main(3))
    assert result.observations == 3 and result.observations_dropped == 17 and counted == 17
    assert exposed >= 17
    watched = [e.text for e in result.events if e.kind == "input"]
    assert watched == lines[-3:]
    assert [e.text for e in result.events if e.kind == "dropped"] == lines[:17]


def test_monitor_bounded_intake_reports_a_failing_source():
    async def main():
        async with tiny_engine() as engine:
            mon = Monitor(engine, task="Watch.", kinds=("a", "b"), threshold=1.1, max_pending=4)
            await mon.run(burst(["x", "y", "z"], fail_after=2))

    with pytest.raises(RuntimeError, match="the source broke"):
        asyncio.run(main())
