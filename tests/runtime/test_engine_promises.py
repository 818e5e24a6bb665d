"""The runtime's promises under agent use (docs/runtime.md, "Interrupts", "Pause and resume",
"Scheduling and fairness"):

- cancel, then act at once: once the task that iterated a generation has been cancelled and awaited
  (or `gen.cancel()` returned), its block takes a new writer without BlockBusyError, whatever the
  task was doing when cancelled (awaiting the next piece, or busy in its loop body: barge-in);
- pause and resume: a sampled generation paused and resumed any number of times produces exactly
  the tokens of the same generation run uninterrupted;
- fairness per coroutine: a coroutine that keeps many short works queued gets the same share of the
  steps as a coroutine with one long work.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cothink.errors import BlockBusyError
from support import ids, make_engine, until


async def _consume(gen, mode: str, rng: random.Random, got: list[int], started: asyncio.Event) -> None:
    """Iterate a generation the way an agent does: speak each piece (await in the loop body), or do
    synchronous work on it, or just collect."""
    started.set()
    async for piece in gen:
        got.extend(piece.token_ids)
        if mode == "speak":  # awaiting something else in the loop body: the barge-in case
            await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002]))
        elif mode == "busy":  # synchronous work, then yield once
            sum(range(rng.randrange(2000)))
            await asyncio.sleep(0)


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
async def test_cancel_then_write_at_once_200_times(kind):
    rng = random.Random(8)
    engine = make_engine(kind, kv_tokens=16384)
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("out")
        await engine.extend(ctx, token_ids=ids(12, 1))
        for trial in range(200):
            mode = rng.choice(["speak", "busy", "plain"])
            got: list[int] = []
            start = len(out)
            gen = engine.generate([ctx, out], max_tokens=50, temperature=0.8, seed=trial, name="speaker")
            started = asyncio.Event()
            task = asyncio.create_task(_consume(gen, mode, rng, got, started))
            await started.wait()  # the task iterates the generation (a task never started iterates nothing)
            # cancel at a random point: before the first piece, mid-stream, between steps
            for _ in range(rng.randrange(12)):
                await asyncio.sleep(rng.choice([0, 0, 0.0005]))
            how = rng.choice(["task", "task", "gen"])
            if how == "task":
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            else:
                gen.cancel()
            # the very next call into the same block must be accepted
            follow = rng.choice(["generate", "extend"])
            if follow == "extend":
                await asyncio.wait_for(engine.extend(out, token_ids=ids(2, trial)), 30)
            else:
                nxt = engine.generate([ctx, out], max_tokens=1, name="next")
                await asyncio.wait_for(nxt.collect(), 30)
            await asyncio.gather(task, return_exceptions=True)
            # what the consumer received is exactly what the cancelled generation left in the block
            assert out.tokens[start : start + len(got)] == got, (trial, mode, how)
            if gen.result is not None:
                assert out.tokens[start : start + len(gen.result.token_ids)] == gen.result.token_ids
            if len(out) > 400:
                engine.truncate(out, 0)
        await until(lambda: engine.occupancy().works == 0)
        assert engine.occupancy().writers == 0


async def test_a_paused_generation_keeps_its_block():
    engine = make_engine("llama")
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("out")
        await engine.extend(ctx, token_ids=ids(8, 2))
        gen = engine.generate([ctx, out], max_tokens=100, name="g")
        await until(lambda: len(out) >= 3)
        gen.pause()
        assert gen.paused
        with pytest.raises(BlockBusyError):
            await engine.extend(out, token_ids=[1])
        await until(lambda: engine.occupancy().in_flight == 0)
        written = len(out)
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert len(out) == written, "a paused generation does not run"
        gen.resume()
        result = await asyncio.wait_for(gen.collect(), 30)
        assert len(result.token_ids) == 100 and result.finish_reason == "length"


@pytest.mark.parametrize("kind", ["llama", "qwen35", "kimi"])
async def test_sampled_pause_resume_equals_uninterrupted(kind):
    rng = random.Random(3)
    engine = make_engine(kind)
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(20, 5))
        params = dict(max_tokens=40, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
        reference = await engine.generate([ctx, engine.block("ref")], **params).collect()
        out = engine.block("out")
        gen = engine.generate([ctx, out], **params, name="paused")
        pauses = 0
        while len(out) < 40 and pauses < 12:
            target = min(40, len(out) + rng.randint(1, 4))
            await until(lambda: len(out) >= target)
            gen.pause()
            pauses += 1
            for _ in range(rng.randrange(5)):
                await asyncio.sleep(rng.choice([0, 0.001]))
            gen.resume()
        result = await asyncio.wait_for(gen.collect(), 30)
    assert pauses >= 5
    assert result.token_ids == reference.token_ids and result.finish_reason == reference.finish_reason


async def test_fairness_between_coroutines_through_the_engine():
    """'many' keeps four short extends in flight at all times; 'one' runs one long extend. Both are
    background with weight 1, so while both run they get equal tokens per step (per-work fairness
    would serve every fresh short work first and starve the long one)."""
    engine = make_engine("llama_1l", max_batch_tokens=32, max_prefill_chunk=32, background_min_tokens=0)
    async with engine:
        long_block = engine.block("long")
        long_task = asyncio.create_task(engine.extend(long_block, token_ids=ids(3000, 1), name="one"))
        stop = asyncio.Event()

        async def short_lane(j: int) -> None:
            block = engine.block(f"short{j}")
            while not stop.is_set():
                await engine.extend(block, token_ids=ids(12, j), name="many")
                if len(block) > 1000:
                    engine.truncate(block, 0)

        lanes = [asyncio.create_task(short_lane(j)) for j in range(4)]
        first = engine.steps
        await until(lambda: engine.steps >= first + 60, timeout=60)
        stop.set()
        await asyncio.gather(*lanes)
        long_task.cancel()
        await asyncio.gather(long_task, return_exceptions=True)
    steps = [r for r in engine.timeline if first < r.index <= first + 60]
    served = {"one": 0, "many": 0}
    for record in steps:
        for item in record.items:
            served[item.coroutine] += item.tokens
    assert served["one"] > 0 and served["many"] > 0
    assert served["one"] / served["many"] == pytest.approx(1, rel=0.15), served
