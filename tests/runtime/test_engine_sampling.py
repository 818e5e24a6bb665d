"""Sampling, stop conditions, interruption, truncation and copy-on-write forks through the engine.

Tiny random Llama with a byte-level tokenizer (tests/support.py): ids 0..255 are bytes, so
`banned_token_ids` = everything but a-z makes the output plain lowercase text, handy for stop strings.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from support import (
    Recorder,
    fresh_runner,
    ids,
    make_engine,
    replay,
    until,
)

LETTERS = list(range(ord("a"), ord("z") + 1))
NOT_LETTERS = [t for t in range(300) if t not in LETTERS]
SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=20)


async def _ctx(engine, seed=1, n=12):
    ctx = engine.block("ctx")
    await engine.extend(ctx, token_ids=ids(n, seed))
    return ctx


async def test_same_seed_same_view_same_output():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        gens = [engine.generate([ctx, engine.block(f"o{i}")], max_tokens=24, seed=7, **SAMPLING, name=f"g{i}")
                for i in range(3)]
        # two run concurrently in the same steps, the third alone afterwards
        first = await asyncio.gather(gens[0].collect(), gens[1].collect())
        third = await gens[2].collect()
    assert first[0].token_ids == first[1].token_ids == third.token_ids
    again = make_engine("llama")
    async with again:
        ctx = await _ctx(again)
        fresh = await again.generate([ctx, again.block("o")], max_tokens=24, seed=7, **SAMPLING).collect()
    assert fresh.token_ids == third.token_ids


async def test_different_seeds_differ():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        results = await asyncio.gather(*(
            engine.generate([ctx, engine.block(f"o{s}")], max_tokens=16, seed=s, **SAMPLING).collect()
            for s in range(6)))
    assert len({tuple(r.token_ids) for r in results}) >= 4


async def test_sampled_tokens_respect_top_k_and_top_p():
    """Each sampled token lies within the top-k tokens and inside the top-p nucleus of the logits the
    engine sampled from (recomputed by a one-at-a-time replay)."""
    engine = make_engine("llama")
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("out")
        rec = Recorder(engine, {"ctx": [ctx], "out": [ctx, out]})
        await engine.extend(ctx, token_ids=ids(12, 1))
        n = 40
        await engine.generate([ctx, out], max_tokens=n, seed=3, temperature=1.5, top_k=20,
                              top_p=0.9).collect()
    rep = replay(rec, fresh_runner(engine.runner))
    for pos in range(n):
        if pos == 0:
            logits = rep.view_logits(["ctx", "out"], {"ctx": 12, "out": 0})
        else:
            logits = rep.logits_before("out", pos)
        token = out.tokens[pos]
        ranked = torch.argsort(logits, descending=True).tolist()
        assert ranked.index(token) < 20, (pos, ranked.index(token))
        probs = torch.softmax(logits[ranked[:20]] / 1.5, dim=-1)
        mass_before = float(probs[: ranked.index(token)].sum())
        assert mass_before < 0.9 + 1e-4, (pos, mass_before)


async def test_greedy_is_argmax_of_runner_logits():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine, n=15)
        out = engine.block("out")
        result = await engine.generate([ctx, out], max_tokens=20).collect()
    runner = fresh_runner(engine.runner)
    ctx2, out2 = runner.new_block("ctx"), runner.new_block("out")
    last = runner.extend(ctx2, ctx.tokens, logits="last")
    forced = runner.extend(out2, result.token_ids, [ctx2, out2])
    predicted = [int(last[-1].argmax())] + forced[:-1].argmax(-1).tolist()
    assert predicted == result.token_ids == out.tokens


async def test_banned_tokens_never_appear():
    engine = make_engine("llama")
    banned = ids(150, 9)
    async with engine:
        ctx = await _ctx(engine)
        sampled = await engine.generate([ctx, engine.block("s")], max_tokens=80, temperature=1.0, seed=1,
                                        banned_token_ids=banned).collect()
        greedy = await engine.generate([ctx, engine.block("g")], max_tokens=40,
                                       banned_token_ids=banned).collect()
        letters = await engine.generate([ctx, engine.block("l")], max_tokens=40,
                                        banned_token_ids=NOT_LETTERS).collect()
    assert not set(sampled.token_ids) & set(banned) and len(sampled.token_ids) == 80
    assert not set(greedy.token_ids) & set(banned)
    assert set(letters.token_ids) <= set(LETTERS) and letters.text.isalpha() and len(letters.text) == 40


async def test_max_tokens_finishes_with_length():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        out = engine.block("out")
        result = await engine.generate([ctx, out], max_tokens=7).collect()
    assert result.finish_reason == "length" and len(result.token_ids) == 7 and len(out) == 7


async def test_stop_strings_cut_the_text():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        full = await engine.generate([ctx, engine.block("full")], max_tokens=40,
                                     banned_token_ids=NOT_LETTERS).collect()
        text = full.text
        stop = text[10:12]
        cut = text.find(stop)
        assert 0 <= cut <= 10
        out = engine.block("out")
        gen = engine.generate([ctx, out], max_tokens=40, banned_token_ids=NOT_LETTERS, stop=stop)
        pieces = [p async for p in gen]
        result = gen.result
        # a list of stop strings: the earliest match wins
        other = await engine.generate([ctx, engine.block("o2")], max_tokens=40, banned_token_ids=NOT_LETTERS,
                                      stop=[text[20:23], stop, "zzzzzzzzzz"]).collect()
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert "".join(p.text for p in pieces) == result.text  # the stop string is never streamed
    assert result.token_ids == full.token_ids[: len(result.token_ids)] == out.tokens
    assert len(result.token_ids) == cut + len(stop)  # one letter per token: it stopped on the match
    assert other.finish_reason == "stop" and other.text == text[:cut]


async def test_stop_token_ids():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        full = await engine.generate([ctx, engine.block("full")], max_tokens=30).collect()
        stop_id = full.token_ids[6]
        k = full.token_ids.index(stop_id)
        out = engine.block("out")
        result = await engine.generate([ctx, out], max_tokens=30, stop_token_ids=[stop_id]).collect()
    assert result.finish_reason == "stop"
    assert result.token_ids == full.token_ids[: k + 1] and result.token_ids[-1] == stop_id
    assert out.tokens == result.token_ids  # the stop token is written
    assert result.text == engine.tokenizer.decode(full.token_ids[:k])  # and not part of the text


async def test_interrupt_keeps_tokens_and_resume_continues():
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        whole = await engine.generate([ctx, engine.block("whole")], max_tokens=20).collect()

        # 1. Generation.cancel() after 5 pieces: the result says 'cancelled' and holds every written token
        out = engine.block("out")
        gen = engine.generate([ctx, out], max_tokens=20)
        got = []
        async for piece in gen:
            got.extend(piece.token_ids)
            if len(got) == 5:
                gen.cancel()
        assert gen.result.finish_reason == "cancelled"
        assert out.tokens == gen.result.token_ids and out.tokens[:5] == got[:5] == whole.token_ids[:5]
        assert len(out) < 20
        # a new generation on the same view continues where it stopped
        rest = await engine.generate([ctx, out], max_tokens=20 - len(out)).collect()
        assert out.tokens == whole.token_ids

        # 2. cancelling the iterating task: every token it received is in the block
        out2 = engine.block("out2")
        received = []

        async def consume():
            async for piece in engine.generate([ctx, out2], max_tokens=20):
                received.extend(piece.token_ids)

        task = asyncio.create_task(consume())
        while len(received) < 8:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        written = len(out2)
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(out2) == written, "the generation stopped with its task"
        assert out2.tokens[: len(received)] == received and 8 <= written < 20
        assert out2.tokens == whole.token_ids[:written]
        await engine.generate([ctx, out2], max_tokens=20 - written).collect()
        assert out2.tokens == whole.token_ids
    assert rest.finish_reason == "length"


async def test_truncate_rewinds():
    engine = make_engine("llama", page_size=4)
    async with engine:
        ctx = await _ctx(engine)
        out = engine.block("out")
        first = await engine.generate([ctx, out], max_tokens=12).collect()
        used = engine.memory().used_pages
        out.truncate(5)
        assert len(out) == 5 and out.tokens == first.token_ids[:5]
        assert engine.memory().used_pages == used - 1  # 12 tokens -> 5 tokens: 3 pages -> 2 pages
        again = await engine.generate([ctx, out], max_tokens=7).collect()
        assert again.token_ids == first.token_ids[5:] and out.tokens == first.token_ids
        engine.truncate(out, 0)
        assert len(out) == 0 and out.tokens == []
        third = await engine.generate([ctx, out], max_tokens=12).collect()
        assert third.token_ids == first.token_ids


async def test_fork_is_copy_on_write():
    engine = make_engine("llama", page_size=16)
    async with engine:
        parent = await _ctx(engine, n=20)  # one full page and one partial page
        store, pool = engine.runner.store, engine.runner.store.pool
        reader = engine.block("reader")
        before_gen = await engine.generate([parent, reader], max_tokens=10).collect()
        parent_kv = pool.k[:, store.slots(parent, 0, 20)].clone()
        used = engine.memory().used_pages

        child = engine.fork(parent, name="child")
        assert child.pages == parent.pages and child.tokens == parent.tokens and len(child) == 20
        assert engine.memory().used_pages == used  # nothing copied yet
        extra = ids(6, 4)
        await engine.extend(child, token_ids=extra)
        assert child.pages[0] == parent.pages[0], "the full page stays shared"
        assert child.pages[1] != parent.pages[1], "the partial page was copied before the child wrote into it"
        assert engine.memory().used_pages == used + 1
        assert len(parent) == 20 and parent.tokens == child.tokens[:20]
        assert torch.equal(pool.k[:, store.slots(parent, 0, 20)], parent_kv)
        # the parent reads as before
        engine.truncate(reader, 0)
        after_gen = await engine.generate([parent, reader], max_tokens=10).collect()
        assert after_gen.token_ids == before_gen.token_ids
        # the child's memory equals a block written directly with the same tokens
        runner = fresh_runner(engine.runner, page_size=16)
        direct = runner.new_block("direct")
        runner.extend(direct, parent.tokens + extra, logits="none")

        def same_kv(block, other):
            mine, theirs = store.slots(block, 0, 26), runner.store.slots(other, 0, 26)
            for cache, other_cache in ((pool.k, runner.store.pool.k), (pool.v, runner.store.pool.v)):
                torch.testing.assert_close(cache[:, mine], other_cache[:, theirs], atol=1e-5, rtol=0)

        same_kv(child, direct)
        # the parent's appends do not leak into the child either
        await engine.extend(parent, token_ids=ids(3, 5))
        assert child.tokens == parent.tokens[:20] + extra and len(parent) == 23
        # the other direction: the PARENT writes first into a page it shares with a new fork
        fork2 = engine.fork(parent, name="fork2")
        fork2_kv = pool.k[:, store.slots(fork2, 0, 23)].clone()
        await engine.extend(parent, token_ids=ids(2, 6))
        assert parent.pages[1] != fork2.pages[1] and parent.pages[0] == fork2.pages[0]
        assert torch.equal(pool.k[:, store.slots(fork2, 0, 23)], fork2_kv) and len(fork2) == 23
        engine.release(fork2)
        engine.release(parent)
        assert len(child) == 26 and child.tokens[20:] == extra  # the child outlives its parent's handle
        same_kv(child, direct)
        engine.release(child)
        engine.release(reader)
        assert engine.memory().live_blocks == 0 and engine.memory().used_pages == 0


async def test_streamed_pieces_carry_every_token():
    """Concatenating the streamed Pieces' token_ids gives the result's token_ids, whatever ends the
    generation (the last token is part of the stream too)."""
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        full = (await engine.generate([ctx, engine.block("full")], max_tokens=30).collect()).token_ids
        k = next(i for i in range(3, 30) if full[i] not in full[:i])  # a token first seen at position k
        letters = await engine.generate([ctx, engine.block("letters")], max_tokens=30,
                                        banned_token_ids=NOT_LETTERS).collect()
        cases = [
            (dict(max_tokens=12), "length"),
            (dict(max_tokens=30, stop_token_ids=[full[k]]), "stop"),
            (dict(max_tokens=30, banned_token_ids=NOT_LETTERS, stop=letters.text[6:8]), "stop"),
        ]
        for kw, reason in cases:
            gen = engine.generate([ctx, engine.block()], **kw)
            streamed = [t for piece in [p async for p in gen] for t in piece.token_ids]
            assert gen.result.finish_reason == reason, kw
            assert streamed == gen.result.token_ids, kw


async def test_cancelled_generation_still_streams_every_written_token():
    """Tokens written before cancel() reach the iterator in pieces, also those queued while the
    consumer was busy: the pieces add up to the result, which the block holds."""
    engine = make_engine("llama")
    async with engine:
        ctx = await _ctx(engine)
        out = engine.block("out")
        gen = engine.generate([ctx, out], max_tokens=200, stop_at_eos=False)
        streamed: list[int] = []
        async for piece in gen:
            streamed.extend(piece.token_ids)
            if len(streamed) == 1:
                await until(lambda: len(out) >= 6)  # busy: five more pieces wait in the queue
                gen.cancel()
        assert gen.result.finish_reason == "cancelled"
        assert len(gen.result.token_ids) >= 6 and streamed == gen.result.token_ids == out.tokens


async def test_generate_without_tokenizer():
    """A checkpoint without tokenizer files: token ids in, token ids out (text stays empty)."""
    from cothink.execution.runner import ModelRunner
    from cothink.runtime.engine import Engine

    base = make_engine("llama").runner
    engine = Engine(ModelRunner(base.model, None, kv_tokens=1024))
    assert engine.tokenizer is None
    async with engine:
        ctx = engine.block("ctx")
        await engine.extend(ctx, token_ids=ids(8, 1))
        out = engine.block("out")
        result = await asyncio.wait_for(engine.generate([ctx, out], max_tokens=6).collect(), 30)
        assert result.token_ids == out.tokens and len(out) == 6 and result.finish_reason == "length"
        assert result.text == ""
        with pytest.raises(ValueError):
            engine.generate([ctx, engine.block("s")], max_tokens=3, stop="x")  # stop strings need a tokenizer


async def test_probe_matches_runner_log_probs():
    """probe() = normalised exp(sum of the choice tokens' log-probs) after the question, read after the view;
    multi-token choices included (" maybe no" is two tokens and shares its first token with " maybe")."""
    engine = make_engine("llama")
    question = "Is it? Answer:"
    choices = (" yes", " no", " maybe", " maybe no", " yes!")
    async with engine:
        ctx = await _ctx(engine, n=20)
        other = engine.block("other")
        await engine.extend(other, token_ids=ids(5, 2), view=[ctx, other])
        probs = await engine.probe([ctx, other], question, choices)
        assert engine.memory().live_blocks == 2, "the probe's scratch blocks are gone"
        assert len(ctx) == 20 and len(other) == 5, "a probe writes nothing the caller can see"
    tok = engine.tokenizer
    runner = fresh_runner(engine.runner)
    c2, o2, q = runner.new_block("ctx"), runner.new_block("other"), runner.new_block("q")
    runner.extend(c2, ctx.tokens, logits="none")
    runner.extend(o2, other.tokens, [c2, o2], logits="none")
    question_ids = tok.encode(question, add_special_tokens=False)
    after_q = torch.log_softmax(runner.extend(q, question_ids, [c2, o2, q])[-1], -1)
    scores = {}
    for choice in choices:
        toks = tok.encode(choice, add_special_tokens=False)
        score = float(after_q[toks[0]])
        if len(toks) > 1:
            fork = runner.fork(q)
            rest = torch.log_softmax(runner.extend(fork, toks[:-1], [c2, o2, fork]), -1)
            score += sum(float(rest[i, t]) for i, t in enumerate(toks[1:]))
        scores[choice] = score
    assert len(tok.encode(" maybe no", add_special_tokens=False)) == 2
    norm = torch.softmax(torch.tensor([scores[c] for c in choices], dtype=torch.float64), 0)
    for choice, p in zip(choices, norm.tolist()):
        assert probs[choice] == pytest.approx(p, abs=1e-5), choice


def test_greedy_pick_is_torchs_argmax_ties_and_nans_included():
    """Greedy picks each row's first largest logit, a NaN if the row has one, as torch's argmax (the
    sampler takes it through numpy on the CPU)."""
    from cothink.execution.sampling import SamplerState, SamplingParams, sample

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    logits[1, [7, 40]] = 50.0  # a tie: the first
    logits[2, [9, 30]] = float("nan")  # NaNs: the first
    logits[3] = float("-inf")  # nothing allowed: index 0
    logits[4, 299] = 60.0  # the last column
    want = logits.argmax(dim=-1).tolist()
    assert want[1:5] == [7, 9, 0, 299]
    states = [SamplerState(SamplingParams()) for _ in range(6)]
    assert [s.token_id for s in sample(logits, states)] == want
    assert [s.token_id for s in sample(logits[2:3], states[:1])] == [9]
    assert [s.token_id for s in sample(logits.T.contiguous().T, states)] == want  # a strided batch
