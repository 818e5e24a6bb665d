"""RollingContext over an endless stream: memory and positions stay flat, a summary stays in front."""

from __future__ import annotations

import pytest
from support import ids, make_engine

from cothink.agents import RollingContext

STREAM = 20_000
APPEND = 100


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
async def test_20k_streamed_tokens_keep_memory_and_positions_flat(kind):
    engine = make_engine(kind, max_context=2048)
    async with engine:
        ctx = RollingContext(engine, "log", block_tokens=200, max_tokens=1000)
        totals, spans, live = [], [], []
        for i in range(STREAM // APPEND):
            await ctx.append(token_ids=ids(APPEND, i))
            mem = engine.memory()
            totals.append(mem.total_bytes_used)
            spans.append(ctx.position_span)
            live.append(mem.live_blocks)
        assert ctx.stats.appended_tokens == STREAM
        assert max(spans) <= 1000 + 200  # bounded however long the stream
        half = len(totals) // 2
        assert max(totals[half:]) <= max(totals[:half])  # flat in the second half
        assert max(live) <= 7
        # the view is usable: a probe reads it
        probs = await engine.probe(ctx.view, [1, 2], (" yes", " no"))
        assert sum(probs.values()) == pytest.approx(1.0)
        if kind == "qwen35":
            assert all(b.sealed for b in ctx.blocks[:-1])  # full blocks drop their GDN records
        ctx.close()
        assert engine.memory().live_blocks == 0


async def test_summary_of_evicted_blocks_stays_in_front():
    engine = make_engine("llama", max_context=2048)
    calls = []

    async def summarize(engine, blocks):
        calls.append([b.name for b in blocks])
        scratch = engine.block("summary-scratch")
        result = await engine.generate([*blocks, scratch], max_tokens=6, stop_at_eos=False).collect()
        engine.release(scratch)
        return result.token_ids

    async with engine:
        ctx = RollingContext(engine, "s", block_tokens=100, max_tokens=300, summarizer=summarize)
        for i in range(20):
            await ctx.append(token_ids=ids(50, i))
            assert ctx.position_span <= 300 + 100 + 6
        assert ctx.summary is not None and ctx.view[0] is ctx.summary and len(ctx.summary) == 6
        assert ctx.stats.summaries == len(calls) >= 5
        assert calls[0] == ["s-0"] and calls[1][0].startswith("s-summary-")  # the old summary is folded in
        with ctx.reading() as view:
            out = engine.block("answer")
            await engine.generate([*view, out], max_tokens=3).collect()
        assert engine.memory().live_blocks == len(ctx.view) + 1


@pytest.mark.slow
async def test_streamed_tokens_on_smollm2():
    """The same promise on the real SmolLM2: a stream three times the window (3,072 tokens of prefill in
    blocks of 128, a window of 1,024). Appends are one block long, so every append is in the same phase
    of the block chain."""
    from support import smollm2_dir

    from cothink import Engine

    block, window, stream = 128, 1024, 3072
    engine = Engine.from_pretrained(smollm2_dir(), kv_tokens=4096)
    async with engine:
        ctx = RollingContext(engine, "log", block_tokens=block, max_tokens=window)
        totals, spans = [], []
        for i in range(stream // block):
            await ctx.append(token_ids=ids(block, i, high=engine.runner.config.vocab_size))
            totals.append(engine.memory().total_bytes_used)
            spans.append(ctx.position_span)
        half = len(totals) // 2
        assert ctx.stats.appended_tokens >= stream and max(spans) <= window + block
        assert max(totals[half:]) <= max(totals[:half])
        assert max(totals) <= (window // 16 + 9) * engine.memory().page_bytes, max(totals)
