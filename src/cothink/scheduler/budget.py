"""Memory admission for the scheduler: may a work grow by n tokens in the next step?

The budget answers admit, wait or fail for each candidate of a step against the pages that will
be free when the step runs and, with a memory budget, against the bytes left under it (KV pages
plus Gated DeltaNet records and summaries plus vision features waiting to be written:
`BlockStore.total_bytes`); it never fails works itself (the scheduler does, after planning).
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    need_bytes: int = 0
    free_bytes: int | None = None


class MemoryBudget:
    def __init__(self, store: BlockStore, on_full: str = "wait", wait_s: float = 30.0):
        if on_full not in ON_POOL_FULL:
            raise ValueError(f"on_pool_full must be one of {ON_POOL_FULL}, got {on_full!r}")
        self.store, self.on_full, self.wait_s = store, on_full, wait_s
        self._free = 0
        self._free_bytes: int | None = None  # left under the memory budget this step (None: no budget)
        # frees memory by spilling idle blocks: (bytes, pages) short -> (bytes, pages) freed
        self.reclaim: Callable[[int, int], tuple[int, int]] | None = None
        self._waiting_since: dict[int, float] = {}
        self._refusals: dict[int, _Refusal] = {}

    def open_step(self) -> None:
        """Start admitting for a new step against the pages free now."""
        self._free = self.store.pool.free_pages
        budget = self.store.budget_bytes
        self._free_bytes = None if budget is None else budget - self.store.total_bytes()

    def pages(self, growth: Growth) -> int:
        store, size = self.store, self.store.page_size
        if growth.block is None:
            return -(-growth.length // size)
        if growth.fork:  # shares the pages; copies the tail page it writes into, then needs fresh ones
            block = growth.block
            fresh = max(0, -(-growth.length // size) - len(block.pages))
            return fresh + (growth.length > block.length and block.length % size != 0)
        return store.pages_needed(growth.block, growth.length)

    def bytes_needed(self, growth: Growth) -> int:
        """Block memory a growth adds: its fresh KV pages and its GDN records (a copy-on-write
        fork's records are copied at its first divergent append, so that copy counts too)."""
        store = self.store
        kv = self.pages(growth) * store.pool.bytes_per_page
        per_token = store.linear_bytes_per_token
        block = growth.block
        if block is None:
            return kv + growth.length * per_token + growth.extra_bytes
        new_tokens = max(0, growth.length - block.length)
        copied = 0
        if per_token and block.linear and (growth.fork or block.linear[0].rows.diverges_on_append()):
            copied = block.length * per_token
        return kv + (new_tokens * per_token + copied if per_token else 0) + growth.extra_bytes

    def admit(self, work: Work, n: int) -> Admission:
        growth = work.growth(n)
        need = sum(self.pages(g) for g in growth)
        need_bytes = sum(self.bytes_needed(g) for g in growth) if self._free_bytes is not None else 0
        fits_bytes = self._free_bytes is None or need_bytes <= self._free_bytes
        if not (need <= self._free and fits_bytes) and self.reclaim is not None:
            short_bytes = 0 if self._free_bytes is None else max(0, need_bytes - self._free_bytes)
            freed_bytes, freed_pages = self.reclaim(short_bytes, max(0, need - self._free))
            self._free += freed_pages
            if self._free_bytes is not None:
                self._free_bytes += freed_bytes
            fits_bytes = self._free_bytes is None or need_bytes <= self._free_bytes
        if need <= self._free and fits_bytes:
            self._free -= need
            if self._free_bytes is not None:
                self._free_bytes -= need_bytes
            self.forget(work)
            return Admission.ADMIT
        budget = self.store.budget_bytes
        never = need > self.store.pool.num_pages or (budget is not None and need_bytes > budget)
        if self.on_full == "error" or never:
            self._refusals[id(work)] = _Refusal(need, self._free, False, need_bytes, self._free_bytes)
            return Admission.FAIL
        since = self._waiting_since.setdefault(id(work), time.perf_counter())
        if time.perf_counter() - since > self.wait_s:
            self._refusals[id(work)] = _Refusal(need, self._free, True, need_bytes, self._free_bytes)
            return Admission.FAIL
        return Admission.WAIT

    def refusal(self, work: Work) -> PoolExhaustedError:
        """The error for a work that admission failed."""
        r = self._refusals.pop(id(work))
        if r.free_bytes is not None and r.need_bytes > r.free_bytes:
            budget = self.store.budget_bytes
            how = f"stayed full for {self.wait_s:.0f}s" if r.waited else "cannot hold the next step"
            return PoolExhaustedError(
                f"memory budget of {budget} bytes {how}: {work.coroutine!r} needs {r.need_bytes} bytes "
                f"(KV pages and GDN records), {max(0, r.free_bytes)} left"
            )
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
