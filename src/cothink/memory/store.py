"""The block store: creates, forks, truncates and frees blocks over the KV pool and linear records."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from cothink.errors import (
    BlockFreedError,
    BlockSealedError,
    InvalidParameterError,
    PoolExhaustedError,
    UnknownBlockError,
)
from cothink.memory.block import Block, GrowingTensor, LinearRecords, SealedRecords
from cothink.memory.pool import KVPool
from cothink.models.config import ModelConfig


@dataclass(frozen=True)
class MemoryStats:
    """Block memory now (docs/runtime.md, "Memory"). Bytes are counted once however many blocks
    share them (forked pages, copy-on-write GDN records)."""

    live_blocks: int
    used_pages: int
    free_pages: int
    page_size: int
    kv_bytes_used: int  # used KV pages x page_bytes
    linear_bytes: int  # GDN records and summaries (same as linear_bytes_used; kept for old callers)
    page_bytes: int = 0  # KV bytes of one page (all attention layers, K and V)
    total_pages: int = 0
    linear_bytes_used: int = 0
    spilled_bytes: int = 0  # block memory written to disk (not resident)
    # kv_bytes_used + linear_bytes_used + vision_bytes_used: what the memory budget bounds
    total_bytes_used: int = 0
    budget_bytes: int | None = None  # the engine's memory_budget (None: only the KV pool bounds memory)
    kv_bytes_per_token: int = 0  # one token's K and V in every attention layer
    linear_bytes_per_token: int = 0  # one token's GDN records in every linear layer (unsealed block)
    sealed_blocks: int = 0
    spilled_blocks: int = 0
    # vision features encoded and not yet written into their blocks (transient; in the total)
    vision_bytes_used: int = 0


def parse_bytes(value: int | str | None) -> int | None:
    """A byte count from an int or a string such as "2GiB", "512MiB", "1.5GB", "4096"."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"not a byte count: {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a byte count must be >= 1, got {value}")
        return value
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"not a byte count: {value!r}") from None
    if unit not in units or amount <= 0:
        raise ValueError(f"not a byte count: {value!r} (use bytes or e.g. '2GiB', '512MB')")
    return int(amount * units[unit])


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
            shared_kv=cfg.shared_kv,
        )
        self.blocks: dict[int, Block] = {}
        self._ids = itertools.count(1)
        self.budget_bytes: int | None = None  # set by the engine (memory_budget)
        self.spilled_bytes = 0  # kept up to date by whoever spills blocks
        # vision features encoded and waiting to be written (held and dropped by the works that own them)
        self.vision_bytes = 0
        # per block id: its page list when its slot table was built, and the table (`_slot_table`)
        self._slot_tables: dict[int, tuple[list[int], torch.Tensor]] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def new_block(self, name: str | None = None) -> Block:
        block_id = next(self._ids)
        block = Block(id=block_id, name=name or f"block-{block_id}")
        block.linear = [self._new_records() for _ in self.linear_slot]
        self.blocks[block_id] = block
        return block

    def _new_records(self) -> LinearRecords:
        g = self.cfg.linear_config  # Gated DeltaNet: g [HV]; KDA: g [H, K]
        assert g is not None
        return LinearRecords(
            rows=GrowingTensor((g.conv_dim,), self.dtype, self.device),
            g=GrowingTensor(g.decay_shape, torch.float32, self.device),
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
        self.pool.release_pages(block.pages)
        for rec in block.linear:
            rec.release()  # copy-on-write sharers keep the rows they read
        if block.spilled is not None:
            self.spilled_bytes -= block.spilled_bytes
            block.spilled.unlink(missing_ok=True)
            block.spilled, block.spilled_bytes = None, 0
        block.pages, block.linear, block.tokens, block.vision = [], [], [], []
        block.freed = True
        del self.blocks[block.id]
        self._slot_tables.pop(block.id, None)

    def fork(self, block: Block, name: str | None = None) -> Block:
        """A copy-on-write copy: pages and GDN records are shared until either side writes where
        the other still reads."""
        self.check(block)
        if block.sealed:
            raise BlockSealedError(f"block {block.name!r} is sealed: it cannot be forked", param="block")
        cut = block.vision_run_cut_by(block.length)
        if cut is not None:
            raise InvalidParameterError(
                f"cannot fork block {block.name!r} while its image at tokens {cut.start - 1}..{cut.stop} "
                "is partly written", param="block",
            )
        child = self.new_block(name or f"{block.name}-fork")
        # Only the committed content: a running step may have reserved pages and appended records
        # beyond block.length that it has not published yet.
        n = block.length
        child.length = n
        child.tokens = list(block.tokens[:n])
        child.pages = block.pages[: -(-n // self.page_size)]
        for page in child.pages:
            self.pool.retain(page)
        child.linear = [rec.share(n) for rec in block.linear]
        child.vision = [run for run in block.vision if run.start < n]
        return child

    def truncate(self, block: Block, n: int) -> None:
        """Keep the first n tokens of the block."""
        self.check(block)
        if block.sealed:
            raise BlockSealedError(f"block {block.name!r} is sealed: it cannot be truncated", param="block")
        if not 0 <= n <= block.length:
            raise ValueError(f"cannot truncate block {block.name!r} of {block.length} tokens to {n}")
        cut = block.vision_run_cut_by(n)
        if cut is not None:
            raise InvalidParameterError(
                f"cannot truncate block {block.name!r} to {n} tokens: that cuts the image at tokens "
                f"{cut.start - 1}..{cut.stop} (keep {cut.start - 1} or {cut.stop + 1} tokens or more)",
                param="n",
            )
        if n == block.length:
            return
        self._drop_pages_after(block, n)
        for rec in block.linear:
            rec.truncate(n)
        del block.tokens[n:]
        block.vision = [run for run in block.vision if run.stop <= n]
        block.length, block.version = n, block.version + 1

    def _drop_pages_after(self, block: Block, n: int) -> None:
        keep = -(-n // self.page_size)
        self.pool.release_pages(block.pages[keep:])
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

    def span(self, block: Block, start: int, stop: int) -> tuple[int, int] | None:
        """(a, b) when the block's tokens [start, stop) sit in the pool slots a..b-1 (their pages
        were allocated one after another), else None; from the page list, no tensor work."""
        if stop <= start:
            return None
        ps, pages = self.page_size, block.pages
        first, last = start // ps, (stop - 1) // ps
        if any(pages[i + 1] != pages[i] + 1 for i in range(first, last)):
            return None
        a = pages[first] * ps + start % ps
        return a, a + (stop - start)

    def slots(self, block: Block, start: int, stop: int) -> torch.Tensor:
        """Flat pool slots of the block's tokens [start, stop)."""
        return self.slots_and_span(block, start, stop)[0]

    def slots_and_span(
        self, block: Block, start: int, stop: int
    ) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """`slots` and `span` of the block's tokens [start, stop), the span found once."""
        span = self.span(block, start, stop)
        device = self.pool.k.device
        if span is not None:
            return torch.arange(*span, device=device), span
        if stop <= start:
            return torch.empty(0, dtype=torch.long, device=device), None
        return self._slot_table(block)[start:stop], None

    def _slot_table(self, block: Block) -> torch.Tensor:
        """Every slot of the block's pages in order ([pages x page_size] long), kept until its page list
        changes: a step plans the slots of every writer whose pages are not consecutive (decoding
        coroutines' blocks take pages in turns), and a decoding writer's list changes once a page,
        so most steps slice the table rather than build it (views of a table are never written)."""
        cached = self._slot_tables.get(block.id)
        if cached is not None and cached[0] == block.pages:
            return cached[1]
        pages = list(block.pages)
        rows = np.asarray(pages, dtype=np.int64)[:, None] * self.page_size
        table = torch.from_numpy((rows + np.arange(self.page_size)).reshape(-1)).to(self.pool.k.device)
        self._slot_tables[block.id] = (pages, table)
        return table

    # ---- accounting -------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.pool.bytes_per_page // self.page_size

    @property
    def linear_bytes_per_token(self) -> int:
        """GDN / KDA record bytes one token adds to an unsealed block: per linear layer, its pre-conv
        [q|k|v] row (model dtype) plus g (fp32, one per value head; KDA: one per key channel) and
        beta (fp32, one per head)."""
        g = self.cfg.linear_config
        if g is None or not self.linear_slot:
            return 0
        return len(self.linear_slot) * g.record_bytes(torch.empty((), dtype=self.dtype).element_size())

    def linear_bytes(self) -> int:
        """GDN bytes of all live blocks; a buffer or summary shared by forks is counted once."""
        seen: set[int] = set()
        total = 0
        for block in self.blocks.values():
            for rec in block.linear:
                if isinstance(rec, SealedRecords):
                    total += sum(t.numel() * t.element_size() for t in rec.tensors())
                    continue
                for part in rec.parts():
                    if part.storage_key() not in seen:
                        seen.add(part.storage_key())
                        total += part.stored_rows() * part.row_bytes
                if rec.summary is not None and id(rec.summary) not in seen:
                    seen.add(id(rec.summary))
                    total += rec.summary.numel() * rec.summary.element_size()
        return total

    def total_bytes(self) -> int:
        return self.pool.used_pages * self.pool.bytes_per_page + self.linear_bytes() + self.vision_bytes

    def stats(self) -> MemoryStats:
        linear = self.linear_bytes()
        kv = self.pool.used_pages * self.pool.bytes_per_page
        return MemoryStats(
            live_blocks=len(self.blocks),
            used_pages=self.pool.used_pages,
            free_pages=self.pool.free_pages,
            page_size=self.page_size,
            kv_bytes_used=kv,
            linear_bytes=linear,
            page_bytes=self.pool.bytes_per_page,
            total_pages=self.pool.num_pages,
            linear_bytes_used=linear,
            spilled_bytes=self.spilled_bytes,
            total_bytes_used=kv + linear + self.vision_bytes,
            budget_bytes=self.budget_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            linear_bytes_per_token=self.linear_bytes_per_token,
            sealed_blocks=sum(b.sealed for b in self.blocks.values()),
            spilled_blocks=sum(b.spilled is not None for b in self.blocks.values()),
            vision_bytes_used=self.vision_bytes,
        )
