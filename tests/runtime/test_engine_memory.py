"""One memory budget (KV + GDN records), copy-on-write GDN forks and sealed blocks, through the engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support import ids, logits_after, make_engine, tiny_folder

import cothink
from cothink.errors import BlockSealedError, InvalidParameterError, PoolExhaustedError
from cothink.memory.snapshot import capture_blocks




async def test_memory_reports_kv_and_gdn_bytes_per_token():
    engine = make_engine("qwen35", page_size=16)
    async with engine:
        block = engine.block("b")
        await engine.extend(block, token_ids=ids(100, 1))
        mem = engine.memory()
    cfg = engine.runner.config
    g = cfg.gdn
    assert mem.linear_bytes_per_token == len(cfg.linear_layers) * (g.conv_dim * 4 + 2 * g.num_v_heads * 4)
    assert mem.kv_bytes_per_token == 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * 4
    assert mem.kv_bytes_used == 7 * mem.page_bytes  # 100 tokens, pages of 16
    assert mem.linear_bytes_used == 100 * mem.linear_bytes_per_token
    assert mem.total_bytes_used == mem.kv_bytes_used + mem.linear_bytes_used
    assert mem.budget_bytes is None and mem.spilled_bytes == 0


@pytest.mark.parametrize("kind", ["qwen35_moe", "qwen3_next", "kimi"])
async def test_memory_bytes_per_token_of_moe_families(kind):
    """Qwen3.5-MoE / Qwen3-Next store what Qwen3.5 stores (K and V per attention layer, GDN records per
    linear layer); Kimi stores one latent row (r + dr values) per MLA layer and, per KDA layer, the
    pre-conv [q|k|v] row, the per-channel log decay g [H, K] and beta [H]."""
    engine = make_engine(kind, page_size=16)
    async with engine:
        block = engine.block("b")
        await engine.extend(block, token_ids=ids(100, 1))
        mem = engine.memory()
        # what a snapshot or spill writes: values apart from keys, except MLA's latent (stored once)
        capture = capture_blocks(engine.runner.store, [block], engine.runner.identity())
        assert all((v is None) == (kind == "kimi") for _, v in capture.pages.values())
    cfg = engine.runner.config
    hf = cfg.hf_text_config
    attn, linear = len(cfg.attention_layers), len(cfg.linear_layers)
    if kind == "kimi":
        kv = attn * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
        hk = hf.linear_num_heads * hf.linear_head_dim
        records = linear * (3 * hk * 4 + hk * 4 + hf.linear_num_heads * 4)
    else:
        kv = attn * 2 * hf.num_key_value_heads * hf.head_dim * 4
        key = hf.linear_num_key_heads * hf.linear_key_head_dim
        value = hf.linear_num_value_heads * hf.linear_value_head_dim
        records = linear * ((2 * key + value) * 4 + 2 * hf.linear_num_value_heads * 4)
    assert mem.kv_bytes_per_token == kv and mem.linear_bytes_per_token == records
    assert mem.kv_bytes_used == 7 * mem.page_bytes == 7 * 16 * kv  # 100 tokens, pages of 16
    assert mem.linear_bytes_used == 100 * records
    assert engine.runner.store.pool.v is engine.runner.store.pool.k or kind != "kimi"  # the latent, once


async def test_budget_counts_gdn_records_in_admission():
    engine = make_engine("qwen35", page_size=16)
    per_token = engine.memory().kv_bytes_per_token + engine.memory().linear_bytes_per_token
    # 64 tokens of KV alone would fit; KV + GDN records do not
    kv_only = 64 * engine.memory().kv_bytes_per_token
    engine = make_engine("qwen35", page_size=16, memory_budget=kv_only + 1, on_pool_full="error")
    async with engine:
        with pytest.raises(PoolExhaustedError, match="memory budget"):
            await engine.extend(engine.block("a"), token_ids=ids(64, 2))
    assert engine.memory().total_bytes_used == 0  # nothing was written
    engine = make_engine("qwen35", page_size=16, memory_budget=64 * per_token, on_pool_full="error")
    async with engine:
        await engine.extend(engine.block("a"), token_ids=ids(64, 2))
        assert engine.memory().total_bytes_used <= engine.memory().budget_bytes


async def test_budget_waits_until_memory_is_released():
    probe = make_engine("qwen35", page_size=16)
    per_token = probe.memory().kv_bytes_per_token + probe.memory().linear_bytes_per_token
    engine = make_engine("qwen35", page_size=16, memory_budget=100 * per_token, pool_wait_s=30, spill=False)
    async with engine:
        first = engine.block("first")
        await engine.extend(first, token_ids=ids(64, 3))
        second = engine.block("second")
        waiting = asyncio.create_task(engine.extend(second, token_ids=ids(64, 4)))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not waiting.done() and len(second) == 0  # over budget: queued, not failed
        engine.release(first)
        await asyncio.wait_for(waiting, 30)
        assert len(second) == 64
        assert engine.memory().total_bytes_used <= engine.memory().budget_bytes


def test_from_pretrained_takes_a_budget_string_and_sizes_the_pool():
    engine = cothink.Engine.from_pretrained(tiny_folder("llama"), memory_budget="1MiB")
    mem = engine.memory()
    assert mem.budget_bytes == 2**20
    assert mem.total_pages * mem.page_bytes >= 2**20 - mem.page_bytes
    with pytest.raises(InvalidParameterError) as err:
        make_engine("llama", memory_budget="a lot")
    assert err.value.param == "memory_budget"


async def test_fork_shares_gdn_records_and_stays_exact():
    engine = make_engine("qwen35")
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(80, 5))
        before = engine.memory().linear_bytes_used
        fork = engine.fork(ctx)
        assert engine.memory().linear_bytes_used == before  # no deep copy
        expected = (await engine.generate(engine.fork(ctx), max_tokens=8).collect()).token_ids
        got = (await engine.generate(fork, max_tokens=8).collect()).token_ids
        assert got == expected
        # the fork's first append copied its records once; the original is untouched
        assert torch.equal(
            logits_after(engine, [ctx], 7), logits_after(engine, [engine.fork(ctx)], 7)
        )


def _record_bytes(block) -> int:
    return sum(
        t.numel() * t.element_size()
        for rec in block.linear
        for t in (rec.tensors() if hasattr(rec, "tensors") else [p.data for p in rec.parts()])
    )


@pytest.mark.parametrize("kind", ["qwen35", "qwen35_moe", "kimi"])  # Gated DeltaNet; KDA (Kimi)
async def test_sealed_gdn_block_memory_is_flat_in_length_and_reads_match(kind):
    engine = make_engine(kind)
    async with engine:
        sealed_size = {}
        for n in (60, 400):
            block = engine.block(f"b{n}")
            await engine.extend(block, token_ids=ids(n, n))
            twin = engine.fork(block)  # an unsealed copy, for comparison
            engine.seal(block)
            assert block.sealed and len(block) == n
            sealed_size[n] = _record_bytes(block)
            # read under many views (probes, scratch reads): total memory stays where it was
            flat = engine.memory().total_bytes_used
            for i in range(4):
                await engine.probe([block], [3, 4, 5 + i], (" yes", " no"))
            assert engine.memory().total_bytes_used == flat
            # what a sealed block gives its readers equals what the unsealed twin gives
            for i in range(3):
                other = engine.block(f"q{i}")
                await engine.extend(other, token_ids=ids(5, 100 + i))
                torch.testing.assert_close(
                    logits_after(engine, [other, block], 3), logits_after(engine, [other, twin], 3),
                    rtol=1e-5, atol=1e-5,
                )
                engine.release(other)
            p = await engine.probe([block], [3, 4, 5], (" yes", " no"))
            q = await engine.probe([twin], [3, 4, 5], (" yes", " no"))
            assert p[" yes"] == pytest.approx(q[" yes"], abs=1e-5)
            out, twin_out = engine.block("o"), engine.block("t")
            a = (await engine.generate([block, out], max_tokens=6).collect()).token_ids
            b = (await engine.generate([twin, twin_out], max_tokens=6).collect()).token_ids
            assert a == b
            for x in (out, twin_out, twin):
                engine.release(x)
        # a sealed block's GDN memory does not depend on its length
        assert sealed_size[60] == sealed_size[400]
        assert sealed_size[400] < 400 * engine.memory().linear_bytes_per_token


async def test_sealed_block_refuses_mutation():
    engine = make_engine("qwen35")
    async with engine:
        block = engine.block("b")
        await engine.extend(block, token_ids=ids(40, 6))
        engine.seal(block)
        engine.seal(block)  # idempotent
        with pytest.raises(BlockSealedError):
            await engine.extend(block, token_ids=[1])
        with pytest.raises(BlockSealedError):
            engine.generate(block, max_tokens=2)
        with pytest.raises(BlockSealedError):
            engine.truncate(block, 3)
        with pytest.raises(BlockSealedError):
            engine.fork(block)
        assert issubclass(BlockSealedError, ValueError) and engine.memory().sealed_blocks == 1
        assert len(block) == 40


async def test_sealing_a_short_block_keeps_its_records():
    engine = make_engine("qwen35")
    async with engine:
        block = engine.block("short")
        await engine.extend(block, token_ids=ids(12, 7))  # records smaller than a summary
        before = engine.memory().linear_bytes_used
        engine.seal(block)
        assert block.sealed and engine.memory().linear_bytes_used == before


async def test_auto_seal_seals_finished_generations_only_when_asked():
    for auto in (False, True):
        engine = make_engine("qwen35", auto_seal=auto)
        async with engine:
            ctx, out = engine.block("ctx"), engine.block("out")
            await engine.extend(ctx, token_ids=ids(30, 8))
            result = await engine.generate([ctx, out], max_tokens=40, stop_at_eos=False).collect()
            assert result.finish_reason == "length"
            assert out.sealed is auto and not ctx.sealed
            if auto:
                with pytest.raises(BlockSealedError):
                    await engine.extend(out, token_ids=[1])
                # a cancelled generation's block is not sealed
                other = engine.block("other")
                gen = engine.generate([ctx, other], max_tokens=1000, stop_at_eos=False)
                async for _ in gen:
                    break
                assert not other.sealed
