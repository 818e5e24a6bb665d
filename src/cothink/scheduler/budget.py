"""Memory admission for the scheduler: may a work grow by n tokens in the next step?

The budget answers admit, wait or fail for each candidate of a step against the pages that will
be free when the step runs; it never fails works itself (the scheduler does, after planning).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cothink.errors import PoolExhaustedError
from cothink.memory.store import BlockStore
from cothink.scheduler.policy import Admission
from cothink.scheduler.work import Growth, Work

ON_POOL_FULL = ("wait", "error")


@dataclass
class _Refusal:
    need: int
    free: int
    waited: bool


class MemoryBudget:
    def __init__(self, store: BlockStore, on_full: str = "wait", wait_s: float = 30.0):
        if on_full not in ON_POOL_FULL:
            raise ValueError(f"on_pool_full must be one of {ON_POOL_FULL}, got {on_full!r}")
        self.store, self.on_full, self.wait_s = store, on_full, wait_s
        self._free = 0
        self._waiting_since: dict[int, float] = {}
        self._refusals: dict[int, _Refusal] = {}

    def open_step(self) -> None:
        """Start admitting for a new step against the pages free now."""
        self._free = self.store.pool.free_pages

    def pages(self, growth: Growth) -> int:
        store, size = self.store, self.store.page_size
        if growth.block is None:
            return -(-growth.length // size)
        if growth.fork:  # shares the pages; copies the tail page it writes into, then needs fresh ones
            block = growth.block
            fresh = max(0, -(-growth.length // size) - len(block.pages))
            return fresh + (growth.length > block.length and block.length % size != 0)
        return store.pages_needed(growth.block, growth.length)

    def admit(self, work: Work, n: int) -> Admission:
        need = sum(self.pages(g) for g in work.growth(n))
        if need <= self._free:
            self._free -= need
            self.forget(work)
            return Admission.ADMIT
        if self.on_full == "error" or need > self.store.pool.num_pages:
            self._refusals[id(work)] = _Refusal(need, self._free, waited=False)
            return Admission.FAIL
        since = self._waiting_since.setdefault(id(work), time.perf_counter())
        if time.perf_counter() - since > self.wait_s:
            self._refusals[id(work)] = _Refusal(need, self._free, waited=True)
            return Admission.FAIL
        return Admission.WAIT

    def refusal(self, work: Work) -> PoolExhaustedError:
        """The error for a work that admission failed."""
        r = self._refusals.pop(id(work))
        if r.waited:
            return PoolExhaustedError(
                f"KV pool stayed full for {self.wait_s:.0f}s; {work.coroutine!r} gave up "
                f"({r.need} pages needed, {r.free} free)"
            )
        return PoolExhaustedError(
            f"KV pool cannot hold the next step of {work.coroutine!r}: {r.need} pages needed, "
            f"{r.free} free of {self.store.pool.num_pages} ({self.store.page_size} tokens each)"
        )

    def forget(self, work: Work) -> None:
        self._waiting_since.pop(id(work), None)
        self._refusals.pop(id(work), None)
