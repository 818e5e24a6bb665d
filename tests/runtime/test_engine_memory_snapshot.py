"""Snapshots: `await engine.save(path, blocks)` / `engine.load(path)`, exact in fp32, in a fresh engine
of this process or of another one; a different model or dtype is refused with a typed error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from support import ids, load_runner, logits_after, make_engine, tiny_folder

from cothink.errors import PoolExhaustedError, SnapshotError, SnapshotMismatchError
from cothink.runtime.engine import Engine




async def _fill(engine):
    ctx = engine.block("ctx")
    await engine.extend(ctx, token_ids=ids(150, 1))
    notes = engine.block("notes")
    await engine.extend(notes, token_ids=ids(90, 2), view=[ctx, notes])
    engine.seal(notes)
    side = engine.fork(ctx, "side")
    await engine.extend(side, token_ids=ids(7, 3))
    return ctx, notes, side


@pytest.mark.parametrize("kind", ["qwen35", "llama", "qwen35_moe", "kimi"])
async def test_round_trip_gives_equal_logits(tmp_path, kind):
    path = tmp_path / "snap.safetensors"
    engine = make_engine(kind)
    async with engine:
        ctx, notes, side = await _fill(engine)
        await engine.save(path, [ctx, notes, side])
        before = [logits_after(engine, v, 5) for v in ([ctx, notes], [side], [notes])]
        out = engine.block("out")
        continued = (await engine.generate([ctx, notes, out], max_tokens=6).collect()).token_ids
    fresh = make_engine(kind)
    async with fresh:
        ctx2, notes2, side2 = fresh.load(path)
        assert [b.name for b in (ctx2, notes2, side2)] == ["ctx", "notes", "side"]
        assert ctx2.tokens == ctx.tokens and len(notes2) == 90 and notes2.sealed and not side2.sealed
        after = [logits_after(fresh, v, 5) for v in ([ctx2, notes2], [side2], [notes2])]
        for a, b in zip(before, after):
            assert torch.equal(a, b)  # bit for bit in fp32
        out2 = fresh.block("out")
        assert (await fresh.generate([ctx2, notes2, out2], max_tokens=6).collect()).token_ids == continued
        # a restored unsealed block is an ordinary block: it grows, truncates and forks
        await fresh.extend(side2, token_ids=[1, 2])
        side2.truncate(3)
        fresh.fork(ctx2)


async def test_snapshot_from_another_model_or_dtype_is_refused(tmp_path):
    path = tmp_path / "snap.safetensors"
    engine = make_engine("qwen35")
    async with engine:
        block = engine.block("b")
        await engine.extend(block, token_ids=ids(20, 4))
        await engine.save(path, [block])
    other = make_engine("llama")
    with pytest.raises(SnapshotMismatchError, match="different model"):
        other.load(path)
    bf16 = Engine(load_runner("qwen35", dtype=torch.bfloat16, kv_tokens=4096))
    with pytest.raises(SnapshotMismatchError, match="dtype"):
        bf16.load(path)
    assert other.memory().live_blocks == 0 and bf16.memory().live_blocks == 0
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a snapshot")
    with pytest.raises(SnapshotError):
        other.load(junk)
    with pytest.raises(SnapshotError):
        other.load(tmp_path / "missing.safetensors")
    small = make_engine("qwen35", memory_budget=1000)
    with pytest.raises(PoolExhaustedError):
        small.load(path)
    assert small.memory().live_blocks == 0


_CHILD = textwrap.dedent("""
    import asyncio, sys, torch
    torch.set_num_threads(1)
    from cothink import Engine

    async def main(folder, snap, out):
        engine = Engine.from_pretrained(folder, kv_tokens=4096)
        async with engine:
            ctx, notes, side = engine.load(snap)
            scratch = engine.runner.new_block("scratch")
            logits = engine.runner.extend(scratch, [5], [ctx, notes, scratch], logits="last")[0]
            torch.save(logits, out)

    asyncio.run(main(*sys.argv[1:]))
""")


async def test_snapshot_loads_in_another_process(tmp_path):
    path, out = tmp_path / "snap.safetensors", tmp_path / "logits.pt"
    engine = make_engine("qwen35")
    async with engine:
        ctx, notes, side = await _fill(engine)
        await engine.save(path, [ctx, notes, side])
        expected = logits_after(engine, [ctx, notes], 5)
    subprocess.run([sys.executable, "-c", _CHILD, str(tiny_folder("qwen35")), str(path), str(out)],
                   check=True, timeout=120)
    assert torch.equal(torch.load(out), expected)
