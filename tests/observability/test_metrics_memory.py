"""The memory gauges of EngineMetrics follow engine.memory() at every scrape: budget, KV and Gated
DeltaNet bytes, sealing and spilling (random Qwen3.5 hybrid, real spill files)."""

from __future__ import annotations

import asyncio

from support import make_engine

from cothink.observability.metrics import EngineMetrics, parse_exposition

GAUGES = {
    "cothink_kv_bytes_used": "kv_bytes_used",
    "cothink_linear_bytes_used": "linear_bytes_used",
    "cothink_total_bytes_used": "total_bytes_used",
    "cothink_spilled_bytes": "spilled_bytes",
    "cothink_sealed_blocks": "sealed_blocks",
    "cothink_spilled_blocks": "spilled_blocks",
    "cothink_memory_budget_bytes": "budget_bytes",
    "cothink_kv_bytes_per_token": "kv_bytes_per_token",
    "cothink_linear_bytes_per_token": "linear_bytes_per_token",
}


def test_memory_gauges_follow_sealing_and_spilling(tmp_path):
    probe = make_engine("qwen35").memory()
    per_token = probe.kv_bytes_per_token + probe.linear_bytes_per_token
    budget = 300 * per_token + 4 * probe.page_bytes  # two 200-token blocks fit, a third one does not

    async def main():
        engine = make_engine("qwen35", memory_budget=budget, spill_dir=tmp_path)
        async with engine:
            metrics = EngineMetrics(engine)
            seen = []

            def scrape() -> None:
                samples = parse_exposition(metrics.exposition().decode())
                stats = engine.memory()
                for gauge, field in GAUGES.items():
                    assert samples[gauge] == getattr(stats, field), gauge
                seen.append(samples)

            scrape()
            a = engine.block("a")
            await engine.extend(a, token_ids=list(range(5, 205)))
            scrape()
            engine.seal(a)
            scrape()
            b = engine.block("b")
            await engine.extend(b, token_ids=list(range(5, 205)))
            c = engine.block("c")
            await engine.extend(c, token_ids=list(range(5, 105)))  # over the budget: one block spills
            scrape()
            return seen

    empty, written, sealed, spilled = asyncio.run(main())
    assert empty["cothink_total_bytes_used"] == 0 and empty["cothink_memory_budget_bytes"] == budget
    assert written["cothink_linear_bytes_used"] > 0 and written["cothink_kv_bytes_used"] > 0
    assert sealed["cothink_sealed_blocks"] == 1
    assert sealed["cothink_linear_bytes_used"] < written["cothink_linear_bytes_used"]  # sealed: smaller
    assert spilled["cothink_spilled_blocks"] == 1 and spilled["cothink_spilled_bytes"] > 0
    assert spilled["cothink_total_bytes_used"] <= budget
    assert list(tmp_path.rglob("*.safetensors"))  # the spilled block is on disk
