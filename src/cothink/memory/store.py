"""The block store: creates, forks, truncates and frees blocks over the KV pool and linear records."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import torch

from cothink.errors import BlockFreedError, PoolExhaustedError, UnknownBlockError
from cothink.memory.block import Block, GrowingTensor, LinearRecords
from cothink.memory.pool import KVPool
from cothink.models.config import ModelConfig


@dataclass(frozen=True)
class MemoryStats:
    live_blocks: int
    used_pages: int
    free_pages: int
    page_size: int
    kv_bytes_used: int
    linear_bytes: int
    page_bytes: int = 0  # KV bytes of one page (all attention layers, K and V)
    total_pages: int = 0


class BlockStore:
    def __init__(
        self, cfg: ModelConfig, kv_tokens: int, page_size: int, dtype: torch.dtype, device: str | torch.device
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.page_size = page_size
        # model layer index -> index among layers of its kind
        self.attn_slot = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        self.linear_slot = {layer: i for i, layer in enumerate(cfg.linear_layers)}
        self.pool = KVPool(
            len(self.attn_slot),
            max(1, -(-kv_tokens // page_size)),
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        self.blocks: dict[int, Block] = {}
        self._ids = itertools.count(1)

    # ---- lifecycle -------------------------------------------------------------------------
    def new_block(self, name: str | None = None) -> Block:
        block_id = next(self._ids)
        block = Block(id=block_id, name=name or f"block-{block_id}")
        block.linear = [self._new_records() for _ in self.linear_slot]
        self.blocks[block_id] = block
        return block

    def _new_records(self) -> LinearRecords:
        g = self.cfg.gdn
        assert g is not None
        return LinearRecords(
            rows=GrowingTensor((g.conv_dim,), self.dtype, self.device),
            g=GrowingTensor((g.num_v_heads,), torch.float32, self.device),
            beta=GrowingTensor((g.num_v_heads,), torch.float32, self.device),
        )

    def check(self, block: Block) -> Block:
        """Raise unless `block` is live in this store."""
        if not isinstance(block, Block):
            raise UnknownBlockError(f"expected a Block, got {type(block).__name__}")
        if block.freed:
            raise BlockFreedError(f"block {block.name!r} (id {block.id}) was freed")
        if self.blocks.get(block.id) is not block:
            raise UnknownBlockError(f"block {block.name!r} (id {block.id}) does not belong to this model")
        return block

    def free(self, block: Block) -> None:
        self.check(block)
        for page in block.pages:
            self.pool.release(page)
        block.pages, block.linear, block.tokens = [], [], []
        block.freed = True
        del self.blocks[block.id]

    def fork(self, block: Block, name: str | None = None) -> Block:
        """A copy-on-write copy: pages are shared until either side writes into a shared page."""
        self.check(block)
        child = self.new_block(name or f"{block.name}-fork")
        # Only the committed content: a running step may have reserved pages and appended records
        # beyond block.length that it has not published yet.
        n = block.length
        child.length = n
        child.tokens = list(block.tokens[:n])
        child.pages = block.pages[: -(-n // self.page_size)]
        for page in child.pages:
            self.pool.retain(page)
        child.linear = [rec.clone(n) for rec in block.linear]
        return child

    def truncate(self, block: Block, n: int) -> None:
        """Keep the first n tokens of the block."""
        self.check(block)
        if not 0 <= n <= block.length:
            raise ValueError(f"cannot truncate block {block.name!r} of {block.length} tokens to {n}")
        if n == block.length:
            return
        self._drop_pages_after(block, n)
        for rec in block.linear:
            rec.truncate(n)
        del block.tokens[n:]
        block.length, block.version = n, block.version + 1

    def _drop_pages_after(self, block: Block, n: int) -> None:
        keep = -(-n // self.page_size)
        for page in block.pages[keep:]:
            self.pool.release(page)
        del block.pages[keep:]

    # ---- pages ------------------------------------------------------------------------------
    def _shared_tail(self, block: Block, new_length: int) -> int | None:
        """The page a block would append into while a fork still shares it (it must be copied first)."""
        if block.length % self.page_size and new_length > block.length:
            page = block.pages[block.length // self.page_size]
            if self.pool.refcount[page] > 1:
                return page
        return None

    def pages_needed(self, block: Block, new_length: int) -> int:
        """Fresh pages that growing `block` to new_length takes, copy-on-write copy included."""
        fresh = max(0, -(-new_length // self.page_size) - len(block.pages))
        return fresh + (self._shared_tail(block, new_length) is not None)

    def reserve(self, growth: list[tuple[Block, int]]) -> None:
        """Make room for each (block, new_length); all or nothing."""
        fresh = sum(max(0, -(-n // self.page_size) - len(b.pages)) for b, n in growth)
        # k writers into one shared page need min(k, refcount - 1) copies: the last one keeps the original
        writers = Counter(p for p in (self._shared_tail(b, n) for b, n in growth) if p is not None)
        copies = sum(min(k, self.pool.refcount[p] - 1) for p, k in writers.items())
        if fresh + copies > self.pool.free_pages:
            raise PoolExhaustedError(
                f"KV pool exhausted: this step needs {fresh + copies} pages, {self.pool.free_pages} free "
                f"of {self.pool.num_pages} ({self.page_size} tokens each)"
            )
        for block, new_length in growth:
            shared = self._shared_tail(block, new_length)
            if shared is not None:
                (copy,) = self.pool.allocate(1)
                self.pool.copy_page(shared, copy)
                self.pool.release(shared)
                block.pages[block.length // self.page_size] = copy
            extra = -(-new_length // self.page_size) - len(block.pages)
            if extra > 0:
                block.pages.extend(self.pool.allocate(extra))

    def unreserve(self, block: Block) -> None:
        """Return pages beyond the block's committed length (after a failed step)."""
        self._drop_pages_after(block, block.length)

    def slots(self, block: Block, start: int, stop: int) -> torch.Tensor:
        """Flat pool slots of the block's tokens [start, stop)."""
        pos = torch.arange(start, stop)
        pages = torch.tensor(block.pages, dtype=torch.long)[pos // self.page_size] if stop > start else pos
        return (pages * self.page_size + pos % self.page_size).to(self.pool.k.device)

    # ---- accounting -------------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        linear = 0
        for block in self.blocks.values():
            for rec in block.linear:
                linear += sum(t.data.numel() * t.data.element_size() for t in (rec.rows, rec.g, rec.beta))
                if rec.summary is not None:
                    linear += rec.summary.numel() * rec.summary.element_size()
        return MemoryStats(
            live_blocks=len(self.blocks),
            used_pages=self.pool.used_pages,
            free_pages=self.pool.free_pages,
            page_size=self.page_size,
            kv_bytes_used=self.pool.used_pages * self.pool.bytes_per_page,
            linear_bytes=linear,
            page_bytes=self.pool.bytes_per_page,
            total_pages=self.pool.num_pages,
        )
