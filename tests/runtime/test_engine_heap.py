"""The heap is frozen while an engine runs (no full collection walks the import-time objects between
two tokens) and given back to the collector when the last engine stops (nothing leaks)."""

from __future__ import annotations

import gc
import weakref

from support import ids, make_engine


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_heap_frozen_while_engines_run_and_released_after_the_last():
    assert gc.get_freeze_count() == 0
    first, second = make_engine("llama"), make_engine("llama")
    garbage = _Cycle()  # alive when the first engine starts: frozen with the heap
    gone = weakref.ref(garbage)
    async with first:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        async with second:  # frozen once: the second engine's start freezes nothing more
            # (not ==: a frozen object freed by its last reference meanwhile, say by another test's
            # thread winding down, leaves the permanent generation; a second freeze would add the
            # second engine's thousands of objects)
            assert gc.get_freeze_count() <= frozen
            later = _Cycle()
            later_gone = weakref.ref(later)
            del garbage, later
            gc.collect()
            assert gone() is not None  # frozen cyclic garbage: untouched while engines run
            assert later_gone() is None  # made after the freeze: collected as usual
            await second.extend(second.block("x"), token_ids=ids(8, 1))
        assert gc.get_freeze_count() > 0  # the first still runs
        y = first.block("y")
        await first.extend(y, token_ids=ids(8, 2))
        out = await first.generate([y], max_tokens=3).collect()
        assert len(out.token_ids) == 3
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # collected once the last engine stopped
