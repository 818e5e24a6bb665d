"""Cancellation stress: 200 cancellations at random (seeded) points across 8 coroutines sharing blocks.

Each coroutine generates into its own block while reading a shared context block and some other
coroutines' blocks; a feeder appends to the context and a prober probes random views (both are
cancelled at random too); blocks are forked, truncated and released along the way. The iterating
asyncio tasks are cancelled at random steps and generations restart on the same views. Checked: only
the expected CancelledErrors occur, nothing deadlocks (asyncio.wait_for around everything), every
block's memory stays consistent with its tokens, and releasing everything returns the pool to its
starting state.

Why the memory check is exact: the model has ONE layer. Its keys and values for a token at block-local
position i are RoPE_i(W_k norm(embed(token))) and W_v norm(embed(token)): they depend on the token and
its position in its own block only, never on the view the block was written under. So a fresh runner
that writes each block's `block.tokens` alone must reproduce the block's stored K/V (up to the float
noise of different batch shapes). Any token recorded but not written, written at the wrong slot, lost
on cancel, or any page freed while still referenced and overwritten by another block, shows up here.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cothink.errors import BlockFreedError
from support import fresh_runner, ids, make_engine, until

N_COROUTINES = 8
N_CANCELS = 200


def _kv(runner, block) -> tuple[torch.Tensor, torch.Tensor]:
    slots = runner.store.slots(block, 0, len(block))
    return runner.store.pool.k[:, slots], runner.store.pool.v[:, slots]


def _check_memory(engine, blocks) -> None:
    fresh = fresh_runner(engine.runner, page_size=engine.runner.store.page_size, kv_tokens=16384)
    for block in blocks:
        assert len(block) == len(block.tokens)
        if not len(block):
            continue
        copy = fresh.new_block(block.name)
        fresh.extend(copy, list(block.tokens), logits="none")
        (k, v), (k2, v2) = _kv(engine.runner, block), _kv(fresh, copy)
        torch.testing.assert_close(k, k2, atol=1e-5, rtol=0, msg=lambda m: f"K of {block.name}: {m}")
        torch.testing.assert_close(v, v2, atol=1e-5, rtol=0, msg=lambda m: f"V of {block.name}: {m}")
        fresh.free(copy)


async def test_cancellation_stress():
    rng = random.Random(20240611)
    engine = make_engine("llama_1l", kv_tokens=16384, page_size=4, max_prefill_chunk=8)
    assert engine.runner.config.num_layers == 1
    free0 = engine.memory().free_pages
    cancelled = 0
    unexpected: list[BaseException] = []

    async def body():
        nonlocal cancelled
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(24, rng))
        outs = [engine.block(f"out{i}") for i in range(N_COROUTINES)]
        views = []
        for i, out in enumerate(outs):
            others = rng.sample([o for o in outs if o is not out], rng.randint(0, 2))
            views.append([ctx, *others, out] if rng.random() < 0.7 else [*others, ctx, out])
        segments: list[list[dict]] = [[] for _ in outs]  # per coroutine: one record per generation
        tasks: dict[int, asyncio.Task] = {}
        forks = []

        def start(i: int) -> None:
            seg = {"start": None, "got": [], "result": None, "max": rng.randint(1, 12)}
            segments[i].append(seg)
            temperature, seed = rng.choice([0.0, 0.0, 0.9]), rng.randrange(10**6)

            async def run() -> None:
                seg["start"] = len(outs[i])
                gen = engine.generate(views[i], max_tokens=seg["max"], temperature=temperature, seed=seed,
                                      name=f"c{i}")
                async for piece in gen:
                    seg["got"].extend(piece.token_ids)
                seg["result"] = gen.result

            tasks[i] = asyncio.create_task(run(), name=f"c{i}")

        async def settle(i: int) -> None:
            """Wait for task i to end; cancellation is the only acceptable exception."""
            task = tasks[i]
            if not task.done():
                await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                unexpected.append(task.exception())
            seg = segments[i][-1]
            seg["end"] = len(outs[i])
            if seg["start"] is not None:
                written = outs[i].tokens[seg["start"] : seg["end"]]
                assert written[: len(seg["got"])] == seg["got"], "a received token is missing from the block"
                if seg["result"] is not None:
                    assert seg["result"].token_ids == written
                    assert seg["result"].finish_reason == "length" and len(written) == seg["max"], (
                        seg, len(outs[i]), [len(b) for b in views[i]], engine.steps)

        async def feeder() -> None:
            while len(ctx) < 150:
                await engine.extend(ctx, token_ids=ids(rng.randint(1, 30), rng), name="feeder")
                for _ in range(rng.randint(1, 8)):
                    await asyncio.sleep(0)

        async def prober() -> None:
            while True:
                view = rng.choice(views)[: rng.randint(1, 3)]
                probs = await engine.probe(view, ids(rng.randint(1, 5), rng), (" yes", " no", "Answer:"),
                                           name="prober")
                assert abs(sum(probs.values()) - 1) < 1e-5

        for i in range(N_COROUTINES):
            start(i)
        side = [asyncio.create_task(feeder()), asyncio.create_task(prober())]
        while cancelled < N_CANCELS:
            target = engine.steps + rng.randint(0, 3)
            await until(lambda: engine.steps >= target, timeout=30)
            i = rng.randrange(N_COROUTINES)
            if not tasks[i].done():
                tasks[i].cancel()
                cancelled += 1
            await settle(i)
            action = rng.random()
            if (action < 0.15 or len(outs[i]) > 120) and len(outs[i]):  # rewind the block before restarting
                engine.truncate(outs[i], rng.randint(0, min(60, len(outs[i]))))
            elif action < 0.3:  # fork a block (possibly one being written) and keep the fork for later
                forks.append(engine.fork(rng.choice(outs + [ctx]), name=f"fork{len(forks)}"))
            elif action < 0.35 and forks:
                engine.release(forks.pop(rng.randrange(len(forks))))
            for k, make in ((0, feeder), (1, prober)):  # sometimes cancel the feeder's extend or a probe
                if rng.random() < 0.05:
                    side[k].cancel()
                    await asyncio.gather(side[k], return_exceptions=True)
                    side[k] = asyncio.create_task(make())
            start(i)
            for j in range(N_COROUTINES):  # restart generations that ended by themselves
                if j != i and tasks[j].done():
                    await settle(j)
                    start(j)
        for i in range(N_COROUTINES):
            tasks[i].cancel()
            await settle(i)
        for t in side:
            t.cancel()
        results = await asyncio.gather(*side, return_exceptions=True)
        unexpected.extend(r for r in results if isinstance(r, BaseException)
                          and not isinstance(r, asyncio.CancelledError))
        return ctx, outs, forks, segments

    async with engine:
        ctx, outs, forks, segments = await asyncio.wait_for(body(), timeout=300)
        for _ in range(3):
            await asyncio.sleep(0)
        assert engine.running, "the step loop died"
        assert not unexpected, unexpected
        assert cancelled == N_CANCELS
        assert sum(len(s) for s in segments) >= N_CANCELS
        assert sum(len(o) for o in outs) > 100 and len(ctx) > 24
        _check_memory(engine, [ctx, *outs, *forks])
        for block in [ctx, *outs, *forks]:
            engine.release(block)
        for _ in range(100):  # a probe whose awaiting task was cancelled may still be finishing its step
            if engine.memory().live_blocks == 0:
                break
            await asyncio.sleep(0.01)
        mem = engine.memory()
        assert mem.live_blocks == 0, mem
        assert mem.free_pages == free0 and mem.used_pages == 0, mem


async def test_cancelling_an_extend_stops_it():
    """Cancelling the task that awaits `engine.extend` stops the extend at the next step, like a generation:
    the chunks already written stay, and the block is free for a new writer at once."""
    engine = make_engine("llama", max_prefill_chunk=16, lone_prefill_chunk=16)  # many steps to cancel in
    async with engine:
        block = engine.block("b")
        task = asyncio.create_task(engine.extend(block, token_ids=ids(400, 1), name="ext"))
        await until(lambda: len(block) >= 32)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        written = len(block)
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(block) == written < 400, "the cancelled extend kept writing"
        assert block.tokens == ids(400, 1)[:written]
        await asyncio.wait_for(engine.extend(block, token_ids=[7, 8]), 10)  # no BlockBusyError
        assert block.tokens[-2:] == [7, 8]


async def test_cancelling_a_probe_stops_it_and_frees_its_scratch_block():
    engine = make_engine("llama", max_prefill_chunk=16, lone_prefill_chunk=16)  # many steps to cancel in
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(10, 1))
        live = engine.memory().live_blocks
        task = asyncio.create_task(engine.probe([ctx], ids(400, 2), (" yes", " no"), name="probe"))
        await until(lambda: "probe" in engine.stats and engine.stats["probe"].forward_passes >= 2)
        passes = engine.stats["probe"].forward_passes
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # The step running when it was cancelled completes (in the worker thread); nothing after it.
        await until(lambda: engine.occupancy().works == 0)
        for _ in range(10):
            await asyncio.sleep(0.001)
        assert engine.stats["probe"].forward_passes <= passes + 1, "the cancelled probe kept running"
        assert engine.memory().live_blocks == live


async def test_release_while_in_use():
    """Releasing a block that a running generation reads keeps its memory until the generation ends;
    releasing the block a generation writes cancels that generation (its tokens stay until freed)."""
    engine = make_engine("llama")
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("out")
        await engine.extend(ctx, token_ids=ids(10, 1))
        ref = engine.block("ref")
        reference = await engine.generate([ctx, ref], max_tokens=12).collect()
        gen = engine.generate([ctx, out], max_tokens=12)
        engine.release(ctx)  # the generation still holds it
        with pytest.raises(BlockFreedError):
            engine.fork(ctx)
        result = await asyncio.wait_for(gen.collect(), 30)
        assert result.token_ids == reference.token_ids
        for _ in range(3):
            await asyncio.sleep(0)
        assert ctx.freed, "the last holder let go: memory returned"
        writer_view = engine.block("ctx2")
        await engine.extend(writer_view, token_ids=ids(10, 1))
        out2 = engine.block("out2")
        gen2 = engine.generate([writer_view, out2], max_tokens=1000)
        await until(lambda: len(out2) >= 3)
        engine.release(out2)
        result2 = await asyncio.wait_for(gen2.collect(), 30)
        assert result2.finish_reason == "cancelled" and 3 <= len(result2.token_ids) < 1000
        for block in (out, ref, writer_view):
            engine.release(block)
        await until(lambda: engine.occupancy().works == 0)  # a step may still have been running
        assert engine.memory().live_blocks == 0 and engine.memory().used_pages == 0
