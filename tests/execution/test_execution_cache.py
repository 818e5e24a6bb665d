"""ExecutionCache: a step's last logits are borrowed rows of the step's tensor, copied out only when
they outlive the next step (docs/architecture.md, execution layer)."""

from __future__ import annotations

import torch

from cothink.execution.cache import ExecutionCache, LastLogits
from cothink.memory.block import Block, view_key


def _blocks(n: int) -> list[Block]:
    blocks = [Block(id=i, name=f"b{i}") for i in range(n)]
    for b in blocks:
        b.length = 1
    return blocks


def test_step_logits_are_borrowed_for_one_step_then_copied():
    cache = ExecutionCache()
    a, b, c = _blocks(3)
    step1 = torch.randn(2, 16)
    cache.set_step_logits(
        [(a, LastLogits(view_key([a]), step1[0])), (b, LastLogits(view_key([b]), step1[1]))]
    )
    assert cache.last_logits([a]).data_ptr() == step1[0].data_ptr()  # no copy yet
    step2 = torch.randn(2, 16)
    # a writes again (its entry is replaced: never copied); b does not (its row is copied out)
    cache.set_step_logits(
        [(a, LastLogits(view_key([a]), step2[0])), (c, LastLogits(view_key([c]), step2[1]))]
    )
    kept = cache.last_logits([b])
    assert (
        torch.equal(kept, step1[1])
        and kept.untyped_storage().data_ptr() != step1.untyped_storage().data_ptr()
    )
    assert cache.last_logits([a]).data_ptr() == step2[0].data_ptr()
    step1.zero_()  # the old step's tensor is no longer referenced by any entry
    assert not torch.equal(cache.last_logits([b]), step1[1])
