"""Who holds which block: the user's handles and the works that read it.

One registry: a block is freed when its handle is released and no registered work reads it
any more. `memory_lock` is held by a running step; truncating a block takes it, so a truncate
lands between steps (never inside one).
"""

from __future__ import annotations

import threading
from collections import Counter

from cothink.errors import BlockFreedError, UnknownBlockError
from cothink.execution.runner import ModelRunner
from cothink.memory.block import Block


class Ownership:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.handles: dict[int, Block] = {}  # blocks the user holds
        self.holds: Counter[int] = Counter()  # handle + works reading it, per block id
        self.memory_lock = threading.Lock()

    def adopt(self, block: Block) -> Block:
        """Register a user handle for a new block."""
        self.handles[block.id] = block
        self.holds[block.id] += 1
        return block

    def check(self, block: object, param: str = "block") -> Block:
        """Raise a typed error unless `block` is a live handle of this engine."""
        if not isinstance(block, Block):
            raise UnknownBlockError(f"expected a Block, got {type(block).__name__}", param=param)
        if self.handles.get(block.id) is not block:
            if block.freed or self.runner.store.blocks.get(block.id) is block:
                raise BlockFreedError(f"block {block.name!r} was released", param=param)
            raise UnknownBlockError(f"block {block.name!r} does not belong to this engine", param=param)
        return block

    def drop_handle(self, block: Block) -> None:
        del self.handles[block.id]
        self.unhold(block)

    def hold(self, block: Block) -> None:
        self.holds[block.id] += 1

    def unhold(self, block: Block) -> bool:
        """Drop one reference; returns True when the block was freed."""
        self.holds[block.id] -= 1
        if self.holds[block.id] > 0:
            return False
        del self.holds[block.id]
        self.runner.free(block)  # no running step reads it: every work that reads a block holds it
        return True
