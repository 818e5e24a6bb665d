"""Which blocks are resident: spill to disk under memory pressure, reload on the next read, pins.

When admission finds the memory budget (or the KV pool) too small for a step, `reclaim` spills
blocks to safetensors files, least recently read first, until the step fits. Only blocks that no
registered work reads (the user's handle is their only hold) and that are not pinned are spilled;
every work holds the blocks it reads from submission to retirement, so a running or admitted step
never loses memory it reads. A spilled block keeps its tokens, name, length and version; its next
read (any call naming it: extend, generate, probe, fork, truncate, seal, save, pin) loads it back
exactly, spilling others if needed. Everything here runs on the event loop, between steps.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from cothink.errors import PoolExhaustedError
from cothink.execution.runner import ModelRunner
from cothink.memory.block import Block
from cothink.memory.snapshot import reload_block, reload_bytes, spill_block
from cothink.scheduler.ownership import Ownership

_engines = itertools.count(1)


class Residency:
    def __init__(self, runner: ModelRunner, ownership: Ownership, directory: Path | None, enabled: bool):
        self.runner, self.ownership, self.enabled = runner, ownership, enabled
        self._directory = directory
        self._tag = f"{os.getpid()}-{next(_engines)}"
        self.spills = 0  # blocks written out (counted for metrics and tests)
        self.reloads = 0

    @property
    def directory(self) -> Path:
        if self._directory is None:
            from cothink.models.hub import cache_dir

            self._directory = cache_dir() / "spill" / self._tag
        self._directory.mkdir(parents=True, exist_ok=True)
        return self._directory

    def candidates(self, keep: frozenset[int] = frozenset()) -> list[Block]:
        """Spillable blocks, least recently read first."""
        holds = self.ownership.holds
        blocks = [
            b for b in self.ownership.handles.values()
            if holds[b.id] == 1 and not b.pinned and b.spilled is None and b.length and b.id not in keep
        ]
        return sorted(blocks, key=lambda b: b.last_read)

    def spill(self, block: Block) -> None:
        path = self.directory / f"block-{block.id}-v{block.version}.safetensors"
        spill_block(self.runner.store, block, path, self.runner.identity())
        self.spills += 1

    def reclaim(
        self, need_bytes: int, need_pages: int, keep: frozenset[int] = frozenset()
    ) -> tuple[int, int]:
        """Spill least recently read blocks until `need_bytes` and `need_pages` are freed (or no
        candidate is left); returns the (bytes, pages) actually freed. Pages or records shared with
        a resident fork are not freed by spilling one side, so the measure is the store's own."""
        if not self.enabled:
            return 0, 0
        store = self.runner.store
        start_bytes, start_pages = store.total_bytes(), store.pool.free_pages
        for block in self.candidates(keep):
            freed_bytes = start_bytes - store.total_bytes()
            freed_pages = store.pool.free_pages - start_pages
            if freed_bytes >= need_bytes and freed_pages >= need_pages:
                break
            self.spill(block)
        return start_bytes - store.total_bytes(), store.pool.free_pages - start_pages

    def ensure_resident(self, blocks: list[Block]) -> None:
        """Reload the spilled blocks among `blocks` (spilling others if memory is short)."""
        store = self.runner.store
        keep = frozenset(b.id for b in blocks)
        for block in blocks:
            if block.spilled is None:
                continue
            need_bytes, need_pages = reload_bytes(store, block)
            short_pages = need_pages - store.pool.free_pages
            budget = store.budget_bytes
            short_bytes = 0 if budget is None else store.total_bytes() + need_bytes - budget
            if short_pages > 0 or short_bytes > 0:
                freed_bytes, freed_pages = self.reclaim(max(0, short_bytes), max(0, short_pages), keep)
                if freed_pages < short_pages or freed_bytes < short_bytes:
                    raise PoolExhaustedError(
                        f"block {block.name!r} is spilled and memory cannot hold it again "
                        f"({need_bytes} bytes, {need_pages} pages needed)", param="view"
                    )
            reload_block(store, block, self.runner.identity())
            self.reloads += 1
