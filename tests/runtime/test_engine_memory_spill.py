"""Spill to disk under the memory budget: least recently read idle blocks first, never pinned ones,
reloaded transparently on their next read, bit for bit in fp32."""

from __future__ import annotations

import pytest
import torch
from support import ids, logits_after, make_engine

TOKENS = 100




def _block_bytes(engine) -> int:
    """Resident bytes of one block of TOKENS tokens (KV pages + GDN records + one body summary)."""
    mem = engine.memory()
    pages = -(-TOKENS // mem.page_size)
    return pages * mem.page_bytes + TOKENS * mem.linear_bytes_per_token + 16_384


def _engine(tmp_path, blocks: int, kind: str = "qwen35"):
    per = _block_bytes(make_engine(kind))
    return make_engine(kind, memory_budget=blocks * per, spill_dir=tmp_path, pool_wait_s=5)


@pytest.mark.parametrize("kind", ["qwen35", "kimi"])
async def test_least_recently_read_block_is_spilled_and_reloads_exactly(tmp_path, kind):
    engine = _engine(tmp_path, 3, kind)
    async with engine:
        a, b, c = (engine.block(n) for n in "abc")
        for i, x in enumerate((a, b, c)):
            await engine.extend(x, token_ids=ids(TOKENS, i))
        before = {x.name: logits_after(engine, [x], 7) for x in (a, b, c)}
        await engine.probe([a], [1, 2], (" yes", " no"))  # a is read again: b is now the oldest read
        d = engine.block("d")
        await engine.extend(d, token_ids=ids(TOKENS, 9))  # over budget: b goes to disk
        mem = engine.memory()
        assert b.spilled is not None and b.spilled.parent == tmp_path and b.spilled.exists()
        assert a.spilled is None and c.spilled is None and d.spilled is None
        assert mem.spilled_blocks == 1 and mem.spilled_bytes == b.spilled_bytes > 0
        assert mem.total_bytes_used <= mem.budget_bytes
        assert len(b) == TOKENS and b.tokens  # the handle keeps its tokens and length

        # the next read brings b back (the least recently read of the others, c, makes room)
        p = await engine.probe([b], [1, 2], (" yes", " no"))
        assert b.spilled is None and c.spilled is not None
        assert torch.equal(logits_after(engine, [b], 7), before["b"])  # bit for bit
        await engine.probe([c], [1, 2], (" yes", " no"))
        assert torch.equal(logits_after(engine, [c], 7), before["c"])
        assert p[" yes"] + p[" no"] > 0.999
        assert engine.memory().total_bytes_used <= engine.memory().budget_bytes

        # a generation reading a spilled block continues as it would have without the spill
        spilled = next(x for x in (a, b, c, d) if x.spilled is not None)
        twin_out = engine.block("twin-out")
        out = engine.block("out")
        got = (await engine.generate([spilled, out], max_tokens=5).collect()).token_ids
        want = (await engine.generate([spilled, twin_out], max_tokens=5).collect()).token_ids
        assert got == want


async def test_pinned_and_busy_blocks_are_never_spilled(tmp_path):
    engine = _engine(tmp_path, 3)
    async with engine:
        a, b, c = (engine.block(n) for n in "abc")
        for i, x in enumerate((a, b, c)):
            await engine.extend(x, token_ids=ids(TOKENS, i))
        engine.pin(a)  # oldest read, but pinned
        d = engine.block("d")
        await engine.extend(d, token_ids=ids(TOKENS, 9))
        assert a.spilled is None and b.spilled is not None
        # fork, truncate and seal of a spilled block reload it first
        engine.truncate(b, 50)
        assert b.spilled is None and len(b) == 50
        assert engine.memory().total_bytes_used <= engine.memory().budget_bytes


async def test_releasing_a_spilled_block_deletes_its_file(tmp_path):
    engine = _engine(tmp_path, 2, kind="llama")
    async with engine:
        a, b = engine.block("a"), engine.block("b")
        await engine.extend(a, token_ids=ids(TOKENS, 1))
        await engine.extend(b, token_ids=ids(TOKENS, 2))
        c = engine.block("c")
        await engine.extend(c, token_ids=ids(TOKENS, 3))
        assert a.spilled is not None
        path = a.spilled
        engine.release(a)
        assert not path.exists() and engine.memory().spilled_bytes == 0
