"""Paged KV memory: forks share pages, a write into a shared tail page copies exactly that page."""

from __future__ import annotations

import pytest
import torch
from support import ids, load_runner, tiny_folder

from cothink.memory.store import BlockStore
from cothink.models.config import load_config

PAGE = 4


@pytest.fixture
def store() -> BlockStore:
    return BlockStore(load_config(tiny_folder("llama")), kv_tokens=64, page_size=PAGE, dtype=torch.float32,
                      device="cpu")


def _write(store: BlockStore, block, n: int, value: float) -> None:
    """Grow `block` to n tokens as a step would: reserve, write its new slots, commit the length."""
    store.reserve([(block, n)])
    slots = store.slots(block, block.length, n)
    store.pool.k[:, slots] = value
    store.pool.v[:, slots] = -value
    block.tokens.extend([0] * (n - block.length))
    block.length = n


def test_slots_follow_the_pages_wherever_they_lie(store):
    """Blocks that grow in turns take pages in turns: a block's slots are its pages' slots in order,
    for any token range (across page edges, within one page, empty), with a span only where its pages
    follow one another."""
    a, b = store.new_block("a"), store.new_block("b")
    for n in range(PAGE, 5 * PAGE + 1, PAGE):  # a page each, in turns: a's pages are not consecutive
        _write(store, a, n - 1, 1.0)
        _write(store, b, n, 2.0)
    assert all(q - p > 1 for p, q in zip(a.pages, a.pages[1:]))
    for start, stop in [(0, 19), (3, 9), (5, 7), (8, 12), (6, 6), (18, 19)]:
        slots, span = store.slots_and_span(a, start, stop)
        want = [a.pages[i // PAGE] * PAGE + i % PAGE for i in range(start, stop)]
        assert slots.dtype == torch.long and slots.tolist() == want
        within_a_page = start < stop and start // PAGE == (stop - 1) // PAGE
        assert span == ((want[0], want[0] + stop - start) if within_a_page else None)


def test_fork_shares_pages_and_a_tail_write_copies_one_page(store):
    pool = store.pool
    parent = store.new_block("parent")
    _write(store, parent, 10, 1.0)  # pages: full, full, tail with 2 of 4 slots used
    assert len(parent.pages) == 3 and pool.used_pages == 3
    child = store.fork(parent)
    assert child.pages == parent.pages and pool.used_pages == 3
    assert [pool.refcount[p] for p in parent.pages] == [2, 2, 2]

    assert store.pages_needed(child, 11) == 1  # the copy of the shared tail page
    _write(store, child, 11, 2.0)
    assert pool.used_pages == 4  # exactly one page more: the copy
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] != parent.pages[2]
    assert [pool.refcount[p] for p in parent.pages] == [2, 2, 1]
    assert pool.refcount[child.pages[2]] == 1
    # the copy carries the parent's first 10 keys; the parent's own tail is untouched by the child's write
    torch.testing.assert_close(pool.k[:, store.slots(child, 0, 10)], pool.k[:, store.slots(parent, 0, 10)])
    assert (pool.k[:, store.slots(parent, 0, 10)] == 1.0).all()
    assert (pool.k[:, store.slots(child, 10, 11)] == 2.0).all()

    # the parent now owns its tail alone: appending into it copies nothing
    assert store.pages_needed(parent, 12) == 0
    _write(store, parent, 12, 3.0)
    assert pool.used_pages == 4
    # growing past the page boundary takes fresh pages only
    _write(store, child, 13, 4.0)
    assert pool.used_pages == 5 and len(child.pages) == 4

    store.free(child)
    assert [pool.refcount[p] for p in parent.pages] == [1, 1, 1]
    store.free(parent)
    assert pool.used_pages == 0 and not any(pool.refcount) and pool.free_pages == pool.num_pages


def test_fork_at_a_page_boundary_shares_full_pages_only(store):
    parent = store.new_block()
    _write(store, parent, 8, 1.0)
    child = store.fork(parent)
    assert store.pages_needed(child, 9) == 1  # a fresh page, no copy: nothing is shared at the tail
    _write(store, child, 9, 2.0)
    assert store.pool.used_pages == 3 and child.pages[:2] == parent.pages
    store.free(parent)
    store.free(child)
    assert not any(store.pool.refcount) and store.pool.free_pages == store.pool.num_pages


def test_many_writers_into_one_shared_tail_copy_all_but_the_last(store):
    """Three holders of a tail page append in one step: two copies, the last writer keeps the original."""
    pool = store.pool
    parent = store.new_block()
    _write(store, parent, 6, 1.0)
    forks = [store.fork(parent), store.fork(parent)]
    tail = parent.pages[1]
    assert pool.refcount[tail] == 3
    store.reserve([(b, 7) for b in (parent, *forks)])
    assert pool.used_pages == 2 + 2
    assert sorted(b.pages[1] for b in (parent, *forks)).count(tail) == 1
    assert all(pool.refcount[b.pages[1]] == 1 for b in (parent, *forks))
    for b in (parent, *forks):
        torch.testing.assert_close(pool.k[:, store.slots(b, 0, 6)], torch.ones_like(pool.k[:, :6]))
        store.free(b)
    assert not any(pool.refcount) and pool.free_pages == pool.num_pages


def test_runner_fork_then_write_leaves_the_parent_exact():
    """Through the model: a fork's write copies one page and the parent's logits do not change."""
    runner = load_runner("llama", kv_tokens=256, page_size=PAGE)
    parent = runner.new_block("parent")
    runner.extend(parent, ids(10, seed=1))
    probe = runner.new_block("probe")
    before = runner.extend(probe, ids(3, seed=2), view=[parent, probe])
    runner.truncate(probe, 0)
    used = runner.store.pool.used_pages
    child = runner.fork(parent)
    runner.extend(child, ids(1, seed=3))
    assert runner.store.pool.used_pages == used + 1
    after = runner.extend(probe, ids(3, seed=2), view=[parent, probe])
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    for b in (parent, child, probe):
        runner.free(b)
    assert runner.store.pool.used_pages == 0 and not any(runner.store.pool.refcount)


def test_span_from_pages_matches_the_slots(store):
    """`span` (from the page list) says when a token range is one slot range; slots agree either way."""
    a, b = store.new_block("a"), store.new_block("b")
    for n in range(1, 4 * PAGE + 1):  # two writers growing in turn: their pages interleave
        _write(store, a, n, 1.0)
        _write(store, b, n, 2.0)
    for block in (a, b):
        for start in range(block.length):
            for stop in range(start + 1, block.length + 1):
                pos = torch.arange(start, stop)
                pages = torch.tensor(block.pages)[pos // PAGE]
                expect = pages * PAGE + pos % PAGE
                assert torch.equal(store.slots(block, start, stop), expect)
                span = store.span(block, start, stop)
                contiguous = bool((expect[1:] - expect[:-1] == 1).all())
                assert (span is not None) == contiguous
                if span is not None:
                    assert span == (int(expect[0]), int(expect[-1]) + 1)


def test_slots_come_from_a_table_kept_until_the_pages_change(store):
    """A block's slots are sliced from one table per page list: two reads under the same pages share
    it, and every change of the list (a new page, a copy-on-write copy of a shared tail page, a
    truncation) gives slots that follow the new pages."""
    a, b = store.new_block("a"), store.new_block("b")
    for n in range(1, 3 * PAGE):  # in turns: a's pages are not consecutive (slots, not a span)
        _write(store, a, n, 1.0)
        _write(store, b, n, 2.0)

    def expect(block, stop):
        return [block.pages[i // PAGE] * PAGE + i % PAGE for i in range(stop)]

    first, again = store.slots(a, 0, a.length), store.slots(a, 1, a.length)
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()
    assert first.tolist() == expect(a, a.length)
    child = store.fork(a)  # shares a's tail page: the child's next write copies it
    _write(store, child, child.length + 1, 3.0)
    assert child.pages[-1] != a.pages[-1]
    assert store.slots(child, 0, child.length).tolist() == expect(child, child.length)
    assert store.slots(a, 0, a.length).tolist() == expect(a, a.length)
    _write(store, a, a.length + PAGE, 4.0)  # a new page
    assert store.slots(a, 0, a.length).tolist() == expect(a, a.length)
    store.truncate(a, PAGE + 1)
    _write(store, b, b.length + 2 * PAGE, 5.0)  # b takes the pages a gave back
    _write(store, a, 3 * PAGE, 6.0)
    assert store.slots(a, 0, a.length).tolist() == expect(a, a.length)
    assert (store.pool.k[:, store.slots(a, 0, a.length)][:, -1] == 6.0).all()


def test_a_freed_block_gives_its_pages_back_in_order(store):
    """A block freed (or truncated) and one of as many pages written next: the new block takes the
    same pages in the same order, so its consecutive pages stay one slot range (a span, read as a
    view) rather than a gathered list."""
    a = store.new_block("a")
    _write(store, a, 3 * PAGE, 1.0)
    pages = list(a.pages)
    assert store.span(a, 0, a.length) is not None
    store.free(a)
    b = store.new_block("b")
    _write(store, b, 3 * PAGE, 2.0)
    assert b.pages == pages and store.span(b, 0, b.length) == (pages[0] * PAGE, pages[0] * PAGE + 3 * PAGE)
    store.truncate(b, PAGE)
    _write(store, b, 3 * PAGE, 3.0)
    assert b.pages == pages
