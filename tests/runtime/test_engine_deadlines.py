"""Deadlines: a work past its deadline is dropped with DeadlineExceededError before it costs compute."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from support import ids, make_engine

from cothink.errors import DeadlineExceededError, InvalidParameterError


async def test_overdue_works_are_dropped_unrun():
    engine = make_engine("llama")
    async with engine:
        block = engine.block("b")
        steps = engine.steps
        with pytest.raises(DeadlineExceededError) as err:
            await engine.extend(block, token_ids=ids(20, 1), deadline=-1.0)
        assert err.value.param == "deadline" and isinstance(err.value, TimeoutError)
        past = datetime.now(timezone.utc) - timedelta(seconds=1)
        with pytest.raises(DeadlineExceededError):
            await engine.probe([engine.block("p")], [1, 2], (" yes", " no"), deadline=past)
        assert engine.steps == steps and len(block) == 0  # no forward pass ran for them
        await engine.extend(block, token_ids=ids(20, 1), deadline=60)  # a later deadline is met
        assert len(block) == 20
        with pytest.raises(InvalidParameterError):
            await engine.extend(block, token_ids=[1], deadline="soon")
        with pytest.raises(InvalidParameterError):
            await engine.extend(block, token_ids=[1], deadline=datetime.now())  # naive datetime


async def test_work_waiting_for_memory_is_dropped_at_its_deadline():
    probe = make_engine("llama")
    per_token = probe.memory().kv_bytes_per_token
    # no spilling: the second extend has to wait for memory the first block keeps
    engine = make_engine("llama", page_size=16, memory_budget=64 * per_token, pool_wait_s=60, spill=False)
    async with engine:
        first = engine.block("first")
        await engine.extend(first, token_ids=ids(64, 2))
        second = engine.block("second")
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(engine.extend(second, token_ids=ids(32, 3), deadline=0.2), 10)
        assert len(second) == 0


async def test_generation_past_its_deadline_stops_with_the_error():
    engine = make_engine("llama")
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(10, 4))
        out = engine.block("out")
        gen = engine.generate([ctx, out], max_tokens=100_000, stop_at_eos=False, deadline=0.3)
        got: list[int] = []
        with pytest.raises(DeadlineExceededError):
            async for piece in gen:
                got.extend(piece.token_ids)
        assert out.tokens == got  # the block holds exactly what was emitted
        await engine.extend(out, token_ids=[1])  # the block takes a new writer
