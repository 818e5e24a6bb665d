"""Per-coroutine accounting: engine.stats agree with the step timeline; work events tell each work's story."""

from __future__ import annotations

import asyncio
from collections import Counter

import torch

from support import ids, make_engine


async def _mixed_workload(engine) -> None:
    ctx = engine.block("ctx")
    await engine.extend(ctx, token_ids=ids(40, 1), name="feed")
    a, b = engine.block("a"), engine.block("b")
    gen_a = engine.generate([ctx, b, a], max_tokens=12, name="A")
    gen_b = engine.generate([ctx, a, b], max_tokens=7, name="B", priority="interactive")
    await asyncio.gather(
        gen_a.collect(), gen_b.collect(),
        engine.extend(ctx, token_ids=ids(50, 2), name="feed"),
        engine.probe([ctx], [1, 2, 3], (" yes", " maybe no"), name="P"),  # a 2-token choice: two passes
        engine.probe([ctx, a], "Answer:", (" yes", " no"), name="P"),
    )
    late = engine.generate([ctx, a, b], max_tokens=3, name="B")  # B's second generation needs a peek step
    await late.collect()


async def test_stats_match_the_timeline():
    engine = make_engine("llama", max_prefill_chunk=16, max_batch_tokens=48)
    records, events = [], []
    engine.step_listeners.append(records.append)
    engine.work_listeners.append(events.append)
    async with engine:
        await _mixed_workload(engine)
    assert engine.steps == len(engine.timeline) == len(records) == engine.timeline[-1].index
    assert list(engine.timeline) == records
    assert [r.index for r in records] == list(range(1, engine.steps + 1))
    assert all(r.start <= r.end for r in records)
    assert all(a.end <= b.start for a, b in zip(records, records[1:]))
    assert all(1 <= r.threads <= torch.get_num_threads() for r in records if r.path)  # a forward ran
    for name in ("feed", "A", "B", "P"):
        items = [it for r in engine.timeline for it in r.items if it.coroutine == name]
        stats = engine.stats[name]
        steps = {r.index for r in engine.timeline for it in r.items if it.coroutine == name}
        assert stats.forward_passes == len(steps) > 0, name  # steps the coroutine took part in
        assert stats.tokens_written == sum(it.tokens for it in items), name
        assert stats.tokens_read == sum(it.view_tokens for it in items), name
        assert all(it.view_tokens >= it.tokens for it in items)
        # one record per work per step: P's two probes may share a step, each with its own record
        per_step = Counter(r.index for r in engine.timeline for it in r.items if it.coroutine == name)
        assert max(per_step.values()) <= engine.stats[name].works
    assert engine.stats["feed"].tokens_written == 90 and engine.stats["feed"].works == 2
    assert engine.stats["A"].works == 1 and len(engine.stats["A"].ttft_s) == 1
    assert engine.stats["B"].works == 2 and len(engine.stats["B"].ttft_s) == 2
    assert engine.stats["P"].works == 2 and engine.stats["P"].forward_passes >= 2
    assert engine.stats["A"].tokens_written >= 12 and engine.stats["B"].tokens_written >= 10
    kinds = {(it.coroutine, it.kind, it.priority) for r in records for it in r.items}
    assert ("B", "generate", "interactive") in kinds and ("A", "generate", "background") in kinds
    assert ("P", "probe", "interactive") in kinds and ("feed", "extend", "background") in kinds

    # every work: submit, scheduled, finish in that order; generations also report their first token
    per_work = Counter((e.coroutine, e.event) for e in events)
    for name, works in (("feed", 2), ("A", 1), ("B", 2), ("P", 2)):
        assert per_work[name, "submit"] == per_work[name, "scheduled"] == per_work[name, "finish"] == works
    assert per_work["A", "first_token"] == 1 and per_work["B", "first_token"] == 2
    finishes = {(e.coroutine, e.detail) for e in events if e.event == "finish"}
    assert ("A", "length") in finishes and ("P", "done") in finishes and ("feed", "done") in finishes
    for e in events:
        if e.event == "scheduled":
            assert abs(e.value - 0) < 60 and e.value >= 0


async def test_stats_survive_a_short_timeline():
    engine = make_engine("llama", timeline_steps=5)
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(10, 1), name="feed")
        await engine.generate([ctx, engine.block("o")], max_tokens=20, name="G").collect()
    assert len(engine.timeline) == 5 and engine.timeline[-1].index == engine.steps
    assert engine.stats["G"].forward_passes == 20 and engine.stats["G"].tokens_written == 20
    # view positions read by G: step k reads ctx (10) + k tokens already written, plus the new token
    assert engine.stats["G"].tokens_read == sum(10 + k + 1 for k in range(20))


async def test_each_step_width_is_tried_on_one_thread():
    """An engine may start beside a busy core, with no quiet figure to notice it by: every width of
    step that ran past its warm-up has had a one-thread step, whatever the machine's load."""
    engine = make_engine("llama", max_prefill_chunk=16, max_batch_tokens=32, lone_prefill_chunk=16, threads=2)
    async with engine:
        await engine.extend(engine.block("ctx"), token_ids=ids(16 * 6, 1))  # six 16-row chunks
    widths = Counter(r.tokens.bit_length() for r in engine.timeline if r.path)
    assert widths[(16).bit_length()] >= 4
    one_thread = {r.tokens.bit_length() for r in engine.timeline if r.path and r.threads == 1}
    assert (16).bit_length() in one_thread
