"""Bad calls raise typed errors at call time and change nothing.

Every case runs on an engine where a bystander coroutine is generating (greedy, 30 tokens). For each bad
call: the error type is checked, it must be raised before any engine step runs (at call time), block
lengths/tokens/versions/pages, the pool's free pages and the live block count must be unchanged, and the
bystander must finish with exactly the tokens it produces on an engine where nothing went wrong.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cothink.errors import (
    BlockBusyError,
    BlockFreedError,
    EmptyInputError,
    EngineClosedError,
    InputTooLongError,
    InvalidViewError,
    PoolExhaustedError,
    UnknownBlockError,
)
from cothink.execution.step import StepItem
from cothink.scheduler.policy import Priority, PriorityClass
from support import VOCAB, ids, load_runner, make_engine, snapshot, until

LIMITS = dict(max_input_tokens=100, max_context=512)
BYSTANDER_TOKENS = 30


async def _bystander_reference() -> list[int]:
    engine = make_engine("llama", **LIMITS)
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("by")
        await engine.extend(ctx, token_ids=ids(10, 1))
        return (await engine.generate([ctx, out], max_tokens=BYSTANDER_TOKENS, name="by").collect()).token_ids


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return asyncio.run(_bystander_reference())


async def _setup(engine) -> SimpleNamespace:
    c = SimpleNamespace(engine=engine)
    c.ctx = engine.block("ctx")
    await engine.extend(c.ctx, token_ids=ids(10, 1))
    c.idle = engine.block("idle")
    await engine.extend(c.idle, token_ids=ids(7, 2), view=[c.ctx, c.idle])
    c.empty = engine.block("empty")
    c.big = engine.block("big")
    for chunk in range(5):  # 500 tokens: near max_context (512)
        await engine.extend(c.big, token_ids=ids(100, 10 + chunk))
    c.gone = engine.block("gone")
    await engine.extend(c.gone, token_ids=[1, 2, 3])
    engine.release(c.gone)
    c.foreign = make_engine("llama").block("foreign")  # a block of another engine (same model)
    c.by = engine.block("by")
    c.gen = engine.generate([c.ctx, c.by], max_tokens=BYSTANDER_TOKENS, name="by")
    c.task = asyncio.create_task(c.gen.collect())
    return c


@dataclass
class Case:
    error: type[BaseException]
    call: object  # c -> result of the call (coroutine, Generation or None)


def _gen(view_of, **kw):
    return lambda c: c.engine.generate(view_of(c), **kw)


CASES: dict[str, Case] = {
    # blocks of another engine
    "foreign-extend": Case(UnknownBlockError, lambda c: c.engine.extend(c.foreign, token_ids=[1])),
    "foreign-in-view": Case(UnknownBlockError, lambda c: c.engine.extend(c.idle, token_ids=[1],
                                                                          view=[c.foreign, c.idle])),
    "foreign-generate": Case(UnknownBlockError, _gen(lambda c: [c.ctx, c.foreign])),
    "foreign-probe": Case(UnknownBlockError, lambda c: c.engine.probe([c.foreign], [1, 2])),
    "foreign-fork": Case(UnknownBlockError, lambda c: c.engine.fork(c.foreign)),
    "foreign-truncate": Case(UnknownBlockError, lambda c: c.engine.truncate(c.foreign, 0)),
    "foreign-release": Case(UnknownBlockError, lambda c: c.engine.release(c.foreign)),
    "not-a-block": Case(UnknownBlockError, lambda c: c.engine.extend("ctx", token_ids=[1])),
    # released blocks
    "released-extend": Case(BlockFreedError, lambda c: c.engine.extend(c.gone, token_ids=[1])),
    "released-in-view": Case(BlockFreedError, _gen(lambda c: [c.gone, c.idle])),
    "released-probe": Case(BlockFreedError, lambda c: c.engine.probe([c.ctx, c.gone], [1])),
    "released-fork": Case(BlockFreedError, lambda c: c.engine.fork(c.gone)),
    "released-truncate": Case(BlockFreedError, lambda c: c.engine.truncate(c.gone, 0)),
    "released-twice": Case(BlockFreedError, lambda c: c.engine.release(c.gone)),
    "released-block-truncate": Case(BlockFreedError, lambda c: c.gone.truncate(0)),
    # malformed views
    "extend-view-ends-elsewhere": Case(InvalidViewError, lambda c: c.engine.extend(c.idle, token_ids=[1],
                                                                                    view=[c.idle, c.ctx])),
    "extend-view-duplicate": Case(InvalidViewError, lambda c: c.engine.extend(c.idle, token_ids=[1],
                                                                               view=[c.ctx, c.ctx, c.idle])),
    "generate-view-duplicate": Case(InvalidViewError, _gen(lambda c: [c.ctx, c.idle, c.ctx])),
    "generate-empty-view": Case(InvalidViewError, _gen(lambda c: [])),
    "truncate-beyond-length": Case(ValueError, lambda c: c.engine.truncate(c.idle, 8)),
    "truncate-negative": Case(ValueError, lambda c: c.engine.truncate(c.idle, -1)),
    # empty input
    "extend-no-tokens": Case(EmptyInputError, lambda c: c.engine.extend(c.idle, token_ids=[])),
    "extend-empty-text": Case(EmptyInputError, lambda c: c.engine.extend(c.idle, text="")),
    "probe-empty-question": Case(EmptyInputError, lambda c: c.engine.probe([c.ctx], "")),
    "probe-no-question-tokens": Case(EmptyInputError, lambda c: c.engine.probe([c.ctx], [])),
    "probe-empty-choice": Case(EmptyInputError, lambda c: c.engine.probe([c.ctx], "Q", (" yes", ""))),
    "generate-nothing-to-continue": Case(EmptyInputError, _gen(lambda c: [c.empty])),
    # too long
    "extend-over-max-input": Case(InputTooLongError,
                                  lambda c: c.engine.extend(c.idle, token_ids=ids(101, 3))),
    "probe-over-max-input": Case(InputTooLongError, lambda c: c.engine.probe([c.ctx], ids(101, 3))),
    "extend-over-max-context": Case(InputTooLongError, lambda c: c.engine.extend(c.idle, token_ids=ids(10, 3),
                                                                                  view=[c.big, c.idle])),
    "probe-over-max-context": Case(InputTooLongError, lambda c: c.engine.probe([c.big, c.idle], ids(10, 3))),
    "generate-at-max-context": Case(InputTooLongError, _gen(lambda c: [c.big, c.ctx, c.idle])),
    # busy blocks
    "generate-into-generating-block": Case(BlockBusyError, _gen(lambda c: [c.ctx, c.by])),
    "generate-into-generating-block-other-view": Case(BlockBusyError, _gen(lambda c: [c.idle, c.by])),
    "extend-into-generating-block": Case(BlockBusyError, lambda c: c.engine.extend(c.by, token_ids=[1])),
    "truncate-generating-block": Case(BlockBusyError, lambda c: c.engine.truncate(c.by, 0)),
    # invalid arguments
    "probe-duplicate-choices": Case(ValueError, lambda c: c.engine.probe([c.ctx], "Q", (" yes", " yes"))),
    "probe-no-choices": Case(ValueError, lambda c: c.engine.probe([c.ctx], "Q", ())),
    "temperature-negative": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], temperature=-0.5)),
    "top-p-zero": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], top_p=0.0)),
    "top-p-above-one": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], top_p=1.5)),
    "top-k-negative": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], top_k=-1)),
    "max-tokens-zero": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], max_tokens=0)),
    "banned-id-out-of-vocab": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], banned_token_ids=[VOCAB + 5])),
    "banned-id-negative": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], banned_token_ids=[-1])),
    "priority-unknown": Case(ValueError, _gen(lambda c: [c.ctx, c.idle], priority="urgent")),
    "priority-weight-zero": Case(ValueError, lambda c: c.engine.generate(
        [c.ctx, c.idle], priority=Priority(PriorityClass.BACKGROUND, 0.0))),
    "text-and-token-ids": Case(ValueError, lambda c: c.engine.extend(c.idle, text="a", token_ids=[1])),
    "neither-text-nor-ids": Case(ValueError, lambda c: c.engine.extend(c.idle)),
    # token ids the model cannot embed: rejected at call time, never inside a step
    "extend-token-id-out-of-vocab": Case(ValueError, lambda c: c.engine.extend(c.idle, token_ids=[1, VOCAB])),
    "extend-token-id-negative": Case(ValueError, lambda c: c.engine.extend(c.idle, token_ids=[-1])),
    "probe-token-id-out-of-vocab": Case(ValueError, lambda c: c.engine.probe([c.ctx], [VOCAB + 1])),
}


async def _call(case: Case, c) -> None:
    result = case.call(c)
    if inspect.isawaitable(result):
        await result


@pytest.mark.parametrize("name", list(CASES))
async def test_bad_call_raises_typed_error_and_changes_nothing(name, reference):
    case = CASES[name]
    engine = make_engine("llama", **LIMITS)
    async with engine:
        c = await _setup(engine)
        watched = [c.ctx, c.idle, c.empty, c.big, c.foreign]
        for _ in range(3):  # let the bystander get going
            await asyncio.sleep(0)
        before, steps, stats = snapshot(engine, watched), engine.steps, dict(engine.stats)
        before_by = (len(c.by), list(c.by.tokens))
        with pytest.raises(case.error):
            async with asyncio.timeout(3):  # same task: the call's synchronous part runs right here
                await _call(case, c)
        assert engine.steps == steps, "the error must be raised at call time, before any step"
        assert snapshot(engine, watched) == before
        assert (len(c.by), list(c.by.tokens)) == before_by
        assert set(engine.stats) == set(stats)
        # the engine keeps serving: the bystander is unaffected and new work runs
        result = await asyncio.wait_for(c.task, 30)
        assert result.token_ids == reference and result.finish_reason == "length"
        await asyncio.wait_for(engine.extend(c.idle, token_ids=[5, 6]), 30)
        assert c.idle.tokens[-2:] == [5, 6]
        assert engine.running


async def test_engine_not_started_raises_engine_closed():
    engine = make_engine("llama")
    block = engine.block("b")
    before = snapshot(engine, [block])
    with pytest.raises(EngineClosedError):
        await engine.extend(block, token_ids=[1, 2])
    with pytest.raises(EngineClosedError):
        await engine.probe([block], [1, 2])
    async with engine:
        await engine.extend(block, token_ids=[1, 2])
    before = snapshot(engine, [block])
    # after stop, work is refused the same way
    with pytest.raises(EngineClosedError):
        engine.generate([block], max_tokens=2)
    with pytest.raises(EngineClosedError):
        await engine.extend(block, token_ids=[3])
    with pytest.raises(EngineClosedError):
        await engine.probe([block], [1, 2])
    assert snapshot(engine, [block]) == before
    assert engine.memory().live_blocks == 1


async def test_pool_exhausted_error_mode():
    """on_pool_full='error': a generation that needs a page the pool does not have fails with
    PoolExhaustedError; what it wrote stays, and the engine keeps serving."""
    engine = make_engine("llama", kv_tokens=64, page_size=16, on_pool_full="error")
    async with engine:
        a = engine.block("a")
        await engine.extend(a, token_ids=ids(40, 1))  # 3 of 4 pages
        out = engine.block("out")
        gen = engine.generate([a, out], max_tokens=40, name="g")
        with pytest.raises(PoolExhaustedError):
            await asyncio.wait_for(gen.collect(), 30)
        assert len(out) == 16 and engine.memory().free_pages == 0
        engine.release(out)
        assert engine.memory().free_pages == 1
        probs = await asyncio.wait_for(engine.probe([a], [1, 2, 3], (" yes", " no")), 30)
        assert sum(probs.values()) == pytest.approx(1.0)
        assert engine.memory().free_pages == 1 and engine.memory().live_blocks == 1


async def test_pool_full_wait_mode_resumes_after_release():
    """on_pool_full='wait': a generation waits for memory and continues once another block is released."""
    engine = make_engine("llama", kv_tokens=64, page_size=16, on_pool_full="wait", pool_wait_s=30)
    async with engine:
        a, hog = engine.block("a"), engine.block("hog")
        await engine.extend(a, token_ids=ids(16, 1))
        await engine.extend(hog, token_ids=ids(32, 2))  # 3 of 4 pages used
        out = engine.block("out")
        task = asyncio.create_task(engine.generate([a, out], max_tokens=20, name="g").collect())
        for _ in range(200):
            await asyncio.sleep(0.001)
            if len(out) == 16:
                break
        await asyncio.sleep(0.05)
        assert len(out) == 16 and not task.done()  # stuck on the full pool, not failed
        engine.release(hog)
        result = await asyncio.wait_for(task, 30)
        assert result.finish_reason == "length" and len(out) == 20


# ---- the runner: a bad step changes nothing ----------------------------------------------------------------
def test_runner_bad_steps_change_nothing():
    runner = load_runner("llama", kv_tokens=1024, page_size=4)
    other = load_runner("llama", kv_tokens=1024, page_size=4)
    a, b = runner.new_block("a"), runner.new_block("b")
    runner.extend(a, ids(9, 1), logits="none")
    runner.extend(b, ids(5, 2), [a, b], logits="none")
    foreign = other.new_block("foreign")
    state = lambda: ([(len(x), list(x.tokens), list(x.pages)) for x in (a, b)],  # noqa: E731
                     runner.store.pool.free_pages, len(runner.store.blocks))
    before = state()
    bad = {
        "same block twice in a step": ([StepItem(b, [1], [a, b]), StepItem(b, [2], [b])], InvalidViewError),
        "view not ending with writer": ([StepItem(b, [1], [b, a])], InvalidViewError),
        "duplicate block in view": ([StepItem(b, [1], [a, a, b])], InvalidViewError),
        "read_lengths too long": ([StepItem(b, [1], [a, b], "all", [10])], InvalidViewError),
        "read_lengths wrong count": ([StepItem(b, [1], [a, b], "all", [1, 2])], InvalidViewError),
        "foreign block": ([StepItem(b, [1], [foreign, b])], UnknownBlockError),
        "no tokens": ([StepItem(b, [], [a, b])], EmptyInputError),
        "token out of vocab": ([StepItem(b, [VOCAB], [a, b])], ValueError),
        "bad logits mode": ([StepItem(b, [1], [a, b], "first")], ValueError),
        "valid item then invalid item": ([StepItem(a, [1]), StepItem(b, [VOCAB], [b])], ValueError),
    }
    for what, (items, error) in bad.items():
        with pytest.raises(error):
            runner.step(items)
        assert state() == before, what
    freed = runner.new_block("freed")
    runner.free(freed)
    with pytest.raises(BlockFreedError):
        runner.extend(freed, [1])
    assert state() == before
    small = load_runner("llama", kv_tokens=64, page_size=4, max_context=12)
    full = small.new_block("full")
    small.extend(full, ids(12, 5), logits="none")
    with pytest.raises(InputTooLongError):
        small.extend(full, [1])
    assert len(full) == 12 and small.store.pool.free_pages == 16 - 3


async def test_stop_while_waiting_for_memory_ends_at_once():
    """An engine whose step loop waits for memory stops: its stop wakes the loop (cancelling the
    waiting generation) and cancels it in the same turn, and neither may swallow the other. Python
    3.11's asyncio.wait_for returned the wake there and the loop slept on forever."""
    engine = make_engine("llama", kv_tokens=32, page_size=16, on_pool_full="wait", pool_wait_s=30)
    await engine.start()
    a = engine.block("a")
    await engine.extend(a, token_ids=ids(16, 1))
    out = engine.block("out")
    gen = engine.generate([a, out], max_tokens=40, name="g")
    await until(lambda: len(out) == 16)
    await asyncio.sleep(0.1)
    for _ in range(5):  # the loop has planned nothing again and sleeps until woken or its next try
        await asyncio.sleep(0)
    stop = asyncio.create_task(engine.stop())
    done, _ = await asyncio.wait({stop}, timeout=10)  # (not wait_for: its timeout would cancel the loop)
    assert stop in done and not engine.running
    assert (await asyncio.wait_for(gen.collect(), 10)).finish_reason == "cancelled"
