"""Coroutines generating concurrently over shared memory produce exactly what a one-at-a-time replay with
the same visibility produces (BRIEF §2 step semantics), on SmolLM2 and with live input.

The replay (tests/support.py) rebuilds every tracked block on a fresh runner, one item per forward
pass, each item reading the other blocks at their lengths at the start of its recorded engine step
(`read_lengths`). Greedy tokens must then be the argmax of the replayed logits, token by token.
"""

from __future__ import annotations

import asyncio

import pytest

from support import (
    Recorder,
    check_greedy,
    fresh_runner,
    ids,
    make_engine,
    replay,
    smollm2_runner,
    until,
)

from cothink.runtime.engine import Engine, EngineLimits


@pytest.fixture(scope="module")
def smol():
    return smollm2_runner()


def _chat(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("start", ["together", "staggered"])
async def test_two_coroutines_reading_each_other_smollm2(smol, start):
    """view_A = [prompt, B_out, A_out], view_B = [prompt, A_out, B_out], 16 greedy tokens each."""
    engine = Engine(fresh_runner(smol, kv_tokens=2048), EngineLimits())
    n = 16
    async with engine:
        prompt, a_out, b_out = engine.block("prompt"), engine.block("A"), engine.block("B")
        views = {"prompt": [prompt], "A": [prompt, b_out, a_out], "B": [prompt, a_out, b_out]}
        rec = Recorder(engine, views)
        prompt_ids = _chat(engine.tokenizer, "List three colours, then three animals.")
        await engine.extend(prompt, token_ids=prompt_ids)
        gen_a = engine.generate(views["A"], max_tokens=n, name="A", stop_at_eos=False)
        task_a = asyncio.create_task(gen_a.collect())
        if start == "staggered":  # B starts once A has written 5 tokens (B's first token needs a peek step)
            await until(lambda: len(a_out) >= 5)
        gen_b = engine.generate(views["B"], max_tokens=n, name="B", stop_at_eos=False)
        res_a, res_b = await asyncio.wait_for(asyncio.gather(task_a, gen_b.collect()), 300)

    assert res_a.token_ids == a_out.tokens and len(a_out) == n and res_a.finish_reason == "length"
    assert res_b.token_ids == b_out.tokens and len(b_out) == n and res_b.finish_reason == "length"
    # they ran in the same forward passes, each reading what the other had written before that step
    shared = [(r, after) for r, after in rec.steps if {i.coroutine for i in r.items} == {"A", "B"}]
    assert len(shared) >= (n - 1 if start == "together" else n - 8)
    before = [{"prompt": 0, "A": 0, "B": 0}] + [after for _, after in rec.steps[:-1]]
    for (record, _), lengths in zip(rec.steps, before):
        for item in record.items:
            if item.coroutine in ("A", "B") and item.kind == "generate":
                # view positions read: every block of the view at its step-start length, plus the new token
                assert item.view_tokens == sum(lengths.values()) + 1, (record.index, item)
    assert any(lengths["B"] > 0 for (r, _), lengths in zip(rec.steps, before)
               if any(i.coroutine == "A" for i in r.items))

    rep = replay(rec, fresh_runner(smol, kv_tokens=2048))
    assert check_greedy(rec, rep, "A", "A", 0, n) == []
    assert check_greedy(rec, rep, "B", "B", 0, n) == []


@pytest.mark.parametrize("kind", ["llama", "qwen35", "qwen35_moe", "kimi"])
async def test_live_input_lands_while_generating(kind):
    """While A generates reading [ctx, A], another coroutine extends ctx by 200 tokens in chunks of 16.
    A never pauses, sees each chunk from the step after it is written, and its tokens equal the replay."""
    engine = make_engine(kind, max_prefill_chunk=16, max_batch_tokens=64)
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("A")
        rec = Recorder(engine, {"ctx": [ctx], "A": [ctx, out]})
        await engine.extend(ctx, token_ids=ids(30, 1), name="setup")
        gen = engine.generate([ctx, out], max_tokens=40, name="A")
        task = asyncio.create_task(gen.collect())
        await until(lambda: len(out) >= 5)
        at = len(out)
        await asyncio.wait_for(engine.extend(ctx, token_ids=ids(200, 2), name="live"), 60)
        during = len(out) - at
        result = await asyncio.wait_for(task, 60)
    assert result.token_ids == out.tokens and len(out) == 40
    assert len(ctx) == 230

    live_steps = [r for r, _ in rec.steps if any(i.coroutine == "live" for i in r.items)]
    assert len(live_steps) == -(-200 // 16)
    assert all(any(i.coroutine == "A" for i in r.items) for r in live_steps), "A paused during the extend"
    assert during >= len(live_steps)
    # A's reads grow with the landed chunks: +1 (its own token) +16 (a chunk) per step while they land
    a_items = [(r.index, i.view_tokens) for r, _ in rec.steps for i in r.items if i.coroutine == "A"]
    growth = [b[1] - a[1] for a, b in zip(a_items, a_items[1:])]
    assert growth.count(17) >= len(live_steps) - 2 and set(growth) <= {1, 17, 9}

    rep = replay(rec, fresh_runner(engine.runner))
    assert check_greedy(rec, rep, "A", "A", 0, 40) == []
    # the live input mattered: without it A continues differently
    quiet = make_engine(kind)
    async with quiet:
        ctx2, out2 = quiet.block("ctx"), quiet.block("A")
        await quiet.extend(ctx2, token_ids=ids(30, 1))
        alone = await quiet.generate([ctx2, out2], max_tokens=40).collect()
    assert alone.token_ids[: at + 2] == result.token_ids[: at + 2]  # the first chunk is seen from token at+2
    assert alone.token_ids != result.token_ids
