"""The block API's contracts: typed errors that change nothing, failed steps that roll back, fork
(copy-on-write), truncate and free.

"Nothing changed" is checked three ways: a snapshot of every block and the pool, and the logits of the
next call, which must be bit-identical to the same call on a runner that never saw the error.
"""

from __future__ import annotations

import pytest
import torch
from reference import ATOL, max_err, random_ids, reference_logits

from cothink.errors import (
    BlockFreedError,
    CothinkError,
    EmptyInputError,
    InputTooLongError,
    InvalidViewError,
    PoolExhaustedError,
    UnknownBlockError,
)
from cothink.execution.step import StepItem

MODEL = "qwen35"  # attention layers (KV pool) and Gated DeltaNet layers (linear records) both
A_IDS, B_IDS, C_IDS = random_ids(10, seed=30), random_ids(9, seed=31), random_ids(5, seed=32)


def snapshot(runner) -> dict:
    """Everything a step may change: per block length, version, pages, records, caches, tokens; the pool."""
    blocks = {}
    for block in runner.store.blocks.values():
        blocks[block.id] = (
            block.length, block.version, tuple(block.pages),
            tuple((r.rows.length, r.g.length, r.beta.length, r.summary_covers) for r in block.linear),
            runner.cache.writer_view(block),
            tuple(getattr(block, "tokens", ())),
        )
    pool = runner.store.pool
    return {"blocks": blocks, "free": pool.free_pages, "refcount": list(pool.refcount),
            "stats": runner.store.stats()}


def _setup(runner):
    a, b = runner.new_block("A"), runner.new_block("B")
    runner.extend(a, A_IDS)
    runner.extend(b, B_IDS, view=[a, b])
    return a, b


def _next_call(runner, a, b):
    """The call whose logits must not notice earlier failures."""
    c = runner.new_block("C")
    return torch.cat([runner.extend(b, C_IDS, view=[a, b]), runner.extend(c, C_IDS[:2], view=[b, a, c])])


def _fresh(tiny_model, call=_next_call):
    """`call(runner, a, b)` on a fresh runner that only ran _setup."""
    runner = tiny_model(MODEL).runner()
    a, b = _setup(runner)
    return call(runner, a, b)


def test_invalid_calls_raise_typed_errors_and_change_nothing(tiny_model):
    runner = tiny_model(MODEL).runner(page_size=4)
    a, b = _setup(runner)
    dead = runner.new_block("dead")
    runner.extend(dead, [1, 2, 3])
    runner.free(dead)
    other = tiny_model(MODEL).runner().new_block("foreign")
    before = snapshot(runner)

    cases = [
        # (error class, message fragment, call)
        (BlockFreedError, "freed", lambda: runner.extend(dead, [1])),
        (BlockFreedError, "freed", lambda: runner.extend(b, [1], view=[dead, b])),
        (BlockFreedError, "freed", lambda: runner.free(dead)),
        (BlockFreedError, "freed", lambda: runner.fork(dead)),
        (BlockFreedError, "freed", lambda: runner.truncate(dead, 0)),
        (InvalidViewError, "end with the written block", lambda: runner.extend(b, [1], view=[b, a])),
        (InvalidViewError, "end with the written block", lambda: runner.extend(b, [1], view=[a])),
        (InvalidViewError, "end with the written block", lambda: runner.extend(b, [1], view=[])),
        (InvalidViewError, "twice", lambda: runner.extend(b, [1], view=[a, a, b])),
        (InvalidViewError, "twice", lambda: runner.extend(b, [1], view=[b, a, b])),
        (EmptyInputError, "no tokens", lambda: runner.extend(b, [], view=[a, b])),
        (ValueError, "token.ids", lambda: runner.extend(b, [runner.config.vocab_size], view=[a, b])),
        (ValueError, "token.ids", lambda: runner.extend(b, [-1], view=[a, b])),
        (ValueError, "token.ids", lambda: runner.extend(b, [True], view=[a, b])),
        (ValueError, "token.ids", lambda: runner.extend(b, [1.0], view=[a, b])),
        (ValueError, "logits", lambda: runner.extend(b, [1], view=[a, b], logits="first")),
        (ValueError, "truncate", lambda: runner.truncate(b, b.length + 1)),
        (ValueError, "truncate", lambda: runner.truncate(b, -1)),
        (InvalidViewError, "same block", lambda: runner.step([StepItem(b, [1], [a, b]), StepItem(b, [2])])),
        # a valid first item does not run when a later item is invalid
        (EmptyInputError, "no tokens", lambda: runner.step([StepItem(a, [1]), StepItem(b, [], [a, b])])),
        (UnknownBlockError, "does not belong", lambda: runner.extend(other, [1])),
        (UnknownBlockError, "does not belong", lambda: runner.extend(b, [1], view=[other, b])),
        (UnknownBlockError, "expected a Block", lambda: runner.extend(b, [1], view=["A", b])),
    ]
    for error, fragment, call in cases:
        with pytest.raises(error, match=fragment) as info:
            call()
        assert isinstance(info.value, CothinkError) or error is ValueError, info.value
        if error is not UnknownBlockError:
            assert isinstance(info.value, ValueError), info.value
        assert snapshot(runner) == before, f"{error.__name__}: {info.value}"

    assert torch.equal(_next_call(runner, a, b), _fresh(tiny_model))


def test_input_too_long_changes_nothing(tiny_model):
    runner = tiny_model(MODEL).runner(max_context=22)
    a, b = _setup(runner)  # 19 positions
    before = snapshot(runner)
    with pytest.raises(InputTooLongError, match="allows 22"):
        runner.extend(b, [1, 2, 3, 4], view=[a, b])
    with pytest.raises(ValueError):  # InputTooLongError is a ValueError
        runner.step([StepItem(runner.new_block("x"), [1] * 23)])
    runner.free(runner.store.blocks[max(runner.store.blocks)])
    assert snapshot(runner) == before
    call = lambda r, a, b: r.extend(b, C_IDS[:3], view=[a, b])  # noqa: E731
    assert torch.equal(call(runner, a, b), _fresh(tiny_model, call))  # 22 positions: allowed


def test_pool_exhausted_step_changes_nothing(tiny_model):
    # 8 pages of 4 tokens: A (10 tokens) takes 3 pages, B (9 tokens) 3, so 2 pages are free
    runner = tiny_model(MODEL).runner(kv_tokens=32, page_size=4)
    a, b = _setup(runner)
    assert runner.store.pool.free_pages == 2
    before = snapshot(runner)
    with pytest.raises(PoolExhaustedError, match="exhausted") as info:
        runner.extend(b, random_ids(12, seed=33), view=[a, b])  # needs 3 more pages
    assert isinstance(info.value, MemoryError)
    assert snapshot(runner) == before
    # all or nothing over the items of one step: each fits alone, not both together
    with pytest.raises(PoolExhaustedError):
        runner.step([StepItem(a, random_ids(6, seed=34)), StepItem(b, random_ids(8, seed=35), [a, b])])
    assert snapshot(runner) == before
    # what fits still runs, and computes what a runner with a large pool computes
    call = lambda r, a, b: r.extend(b, C_IDS, view=[a, b])  # noqa: E731
    assert torch.equal(call(runner, a, b), _fresh(tiny_model, call))


def test_failure_inside_the_forward_rolls_back(tiny_model, monkeypatch):
    runner = tiny_model(MODEL).runner(page_size=4)
    a, b = _setup(runner)
    before = snapshot(runner)
    last = runner.model.model.layers[-1].mlp

    def boom(x):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(last, "forward", boom)
    n = runner.new_block("n")
    for call in (lambda: runner.extend(b, random_ids(7, seed=36), view=[a, b]),
                 lambda: runner.step([StepItem(a, [5, 6]), StepItem(n, [7], [a, n])])):
        with pytest.raises(RuntimeError, match="injected"):
            call()
    monkeypatch.undo()
    assert n.length == 0 and n.pages == [] and all(rec.rows.length == 0 for rec in n.linear)
    runner.free(n)  # the block made for the failed step
    assert snapshot(runner) == before
    assert torch.equal(_next_call(runner, a, b), _fresh(tiny_model))


def test_fork_shares_pages_and_copies_on_write(tiny_model):
    runner = tiny_model(MODEL).runner(page_size=4)
    base = runner.new_block("base")
    runner.extend(base, random_ids(4, seed=37))
    a = runner.new_block("A")
    runner.extend(a, A_IDS, view=[base, a])  # 10 tokens: 3 pages, the last one half full
    used = runner.store.pool.used_pages
    child = runner.fork(a, "child")
    assert child.length == a.length and child.pages == a.pages
    assert runner.store.pool.used_pages == used  # shared, not copied
    assert all(runner.store.pool.refcount[p] == 2 for p in a.pages)

    x_ids, y_ids = random_ids(2, seed=38), random_ids(6, seed=39)  # the child stays within its 3 pages
    want_child = reference_logits(runner, [base, child], x_ids)
    got_child = runner.extend(child, x_ids, view=[base, child])  # writes into the shared last page
    assert max_err(got_child, want_child) < ATOL
    assert runner.store.pool.used_pages == used + 1  # exactly the written page was copied
    assert child.pages[:2] == a.pages[:2] and child.pages[2] != a.pages[2]
    assert a.length == 10

    want_parent = reference_logits(runner, [base, a], y_ids)
    got_parent = runner.extend(a, y_ids, view=[base, a])  # its last page is no longer shared: in place
    assert max_err(got_parent, want_parent) < ATOL

    # Each side equals a fresh computation of its own tokens.
    fresh = tiny_model(MODEL).runner()
    fb = fresh.new_block()
    fresh.extend(fb, random_ids(4, seed=37))
    for block, ids, got in ((child, x_ids, got_child), (a, y_ids, got_parent)):
        f = fresh.new_block()
        fresh.extend(f, A_IDS, view=[fb, f])
        assert max_err(fresh.extend(f, ids, view=[fb, f]), got) < 1e-5
    # and readers of either side see its own content
    for block, ids in ((child, x_ids), (a, y_ids)):
        r = runner.new_block()
        probe = random_ids(2, seed=40)
        want = reference_logits(runner, [base, block, r], probe)
        assert max_err(runner.extend(r, probe, view=[base, block, r]), want) < ATOL
        f, g = fresh.new_block(), fresh.new_block()
        fresh.extend(f, A_IDS + ids, view=[fb, f])
        assert max_err(fresh.extend(g, probe, view=[fb, f, g]), want) < ATOL


def test_fork_keeps_gdn_state_of_parent(tiny_model):
    """A fork read under the parent's view continues exactly as the parent would."""
    runner = tiny_model("qwen35_linear").runner()
    x = runner.new_block("X")
    runner.extend(x, random_ids(20, seed=41))
    p = runner.new_block("P")
    runner.extend(p, random_ids(30, seed=42), view=[x, p])
    child = runner.fork(p)
    ids = random_ids(4, seed=43)
    got_child = runner.extend(child, ids, view=[x, child])
    got_parent = runner.extend(p, ids, view=[x, p])  # cached writer state vs recomposed state
    assert max_err(got_child, got_parent) < 1e-5


def test_truncate_then_extend_matches_fresh(tiny_model):
    runner = tiny_model(MODEL).runner(page_size=4, dense_summary_min_tokens=8)
    ids = random_ids(40, seed=44)
    a = runner.new_block("A")
    runner.extend(a, ids)
    reader = runner.new_block("R")
    runner.extend(reader, [1, 2], view=[a, reader])  # builds A's dense GDN summaries over 40 tokens
    assert all(rec.summary_covers == 40 for rec in a.linear)
    pages, version = runner.store.pool.used_pages, a.version
    runner.truncate(a, 7)
    assert a.length == 7 and a.version == version + 1 and len(a.pages) == 2
    assert runner.store.pool.used_pages == pages - 8  # 10 pages for 40 tokens -> 2 for 7
    assert all(rec.summary is None for rec in a.linear)  # stale summaries dropped

    more = random_ids(25, seed=45)
    got = runner.extend(a, more)
    fresh = tiny_model(MODEL).runner()
    want = fresh.extend(fresh.new_block(), ids[:7] + more)[7:]
    assert max_err(got, want) < ATOL
    r2 = runner.new_block()
    got_reader = runner.extend(r2, [3], view=[a, r2])
    assert max_err(got_reader, tiny_model(MODEL).logits(ids[:7] + more + [3])[-1:]) < ATOL

    runner.truncate(a, 0)
    assert a.length == 0 and a.pages == []
    assert max_err(runner.extend(a, ids[:5]), fresh.extend(fresh.new_block(), ids[:5])) < 1e-6


def test_truncating_a_parent_leaves_the_fork_alone(tiny_model):
    runner = tiny_model(MODEL).runner(page_size=4)
    a = runner.new_block("A")
    runner.extend(a, A_IDS)
    child = runner.fork(a)
    runner.truncate(a, 3)
    runner.extend(a, [7, 8, 9])
    r = runner.new_block()
    got = runner.extend(r, [4], view=[child, r])
    assert max_err(got, tiny_model(MODEL).logits(A_IDS + [4])[-1:]) < ATOL


def test_free_returns_the_pool_to_its_starting_size(tiny_model):
    runner = tiny_model(MODEL).runner(page_size=4)
    pool = runner.store.pool
    start = pool.free_pages
    a, b = _setup(runner)
    c = runner.fork(b)
    runner.extend(c, [1, 2, 3], view=[a, c])
    d = runner.fork(a)
    runner.truncate(d, 2)
    e = runner.new_block()  # never written
    assert pool.free_pages < start
    for block in (b, a, e, d, c):  # parents before children: shared pages live until the last holder goes
        runner.free(block)
    assert pool.free_pages == start and runner.store.stats().live_blocks == 0
    assert all(count == 0 for count in pool.refcount)
    assert runner.store.stats().used_pages == 0 and runner.store.stats().linear_bytes == 0


def test_step_writing_a_block_and_its_fork_needs_one_copy(tiny_model):
    runner = tiny_model("llama").runner(kv_tokens=16, page_size=4)  # 4 pages
    parent = runner.new_block("P")
    runner.extend(parent, A_IDS)  # 3 pages, the last one half full
    child = runner.fork(parent)
    assert runner.store.pool.free_pages == 1
    # The first writer copies the shared page; the second then holds it alone and writes in place.
    runner.step([StepItem(parent, [1]), StepItem(child, [2])])
    assert runner.store.pool.free_pages == 0
