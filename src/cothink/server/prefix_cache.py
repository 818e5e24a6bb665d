"""Prefix reuse across OpenAI requests: prompts already in memory are forked instead of prefilled again.

After a request's prompt is prefilled, the cache keeps a copy-on-write fork of its block (it shares the
pages, so it costs nothing until evicted). A later prompt of the same account starts from a fork of
the cached block with the longest common token prefix, truncated to that prefix, and prefills only
the rest. Entries are per account (an API key), so no key can learn from timing what another key
sent. The cache holds at most `max_pages` pages (least recently used entries go first) and gives
pages back when the pool runs short (`make_room`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cothink.memory.block import Block
    from cothink.runtime.engine import Engine


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix (binary search over C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class Entry:
    account: str
    tokens: tuple[int, ...]
    block: Block
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class PrefixCache:
    engine: Engine
    max_pages: int
    page_size: int
    min_tokens: int = 16  # shorter matches are not worth a fork
    max_entries: int = 256
    entries: list[Entry] = field(default_factory=list)
    hit_tokens: int = 0
    miss_tokens: int = 0

    def pages(self) -> int:
        return sum(-(-len(e.tokens) // self.page_size) for e in self.entries)

    def start(self, account: str, ids: list[int], name: str) -> tuple[Block, int]:
        """A block holding the longest cached prefix of `ids` (a fork) and that prefix's length; a
        fresh empty block and 0 on a miss. At least one token is always left to prefill."""
        key = tuple(ids)
        best, length = None, 0
        for entry in self.entries:
            if entry.account == account:
                n = common_prefix(entry.tokens, key)
                if n > length:
                    best, length = entry, n
        length = min(length, len(ids) - 1)
        if best is None or length < self.min_tokens:
            self.miss_tokens += len(ids)
            return self.engine.block(name), 0
        block = self.engine.fork(best.block, name)
        if block.length > length:
            self.engine.truncate(block, length)
        best.last_used = time.monotonic()
        self.hit_tokens += length
        self.miss_tokens += len(ids) - length
        return block, length

    def insert(self, account: str, ids: list[int], block: Block) -> None:
        """Remember `block` (holding exactly `ids`) for later requests of `account`."""
        if len(ids) < self.min_tokens or self.max_pages <= 0:
            return
        key = tuple(ids)
        for entry in list(self.entries):
            # an entry this prompt extends (or repeats) is superseded: the new one covers it
            if entry.account == account and common_prefix(entry.tokens, key) == len(entry.tokens):
                self._drop(entry)
        self.entries.append(Entry(account, key, self.engine.fork(block)))
        while self.entries and (self.pages() > self.max_pages or len(self.entries) > self.max_entries):
            self._drop(min(self.entries, key=lambda e: e.last_used))

    def make_room(self, pages: int) -> int:
        """Evict least recently used entries until `pages` pages are free in the pool (or the cache is
        empty); returns how many entries went."""
        dropped = 0
        while self.entries and self.engine.memory().free_pages < pages:
            self._drop(min(self.entries, key=lambda e: e.last_used))
            dropped += 1
        return dropped

    def shrink_to(self, pages: int) -> int:
        """Evict least recently used entries until the cache counts at most `pages` pages; returns how
        many entries went (the memory ledger calls it when the accounts' promises grow)."""
        dropped = 0
        while self.entries and self.pages() > pages:
            self._drop(min(self.entries, key=lambda e: e.last_used))
            dropped += 1
        return dropped

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        if not entry.block.freed:
            self.engine.release(entry.block)

    def clear(self) -> None:
        for entry in list(self.entries):
            self._drop(entry)
