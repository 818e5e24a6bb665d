"""What the execution layer remembers about blocks between steps, in one registry per runner.

A block (cothink.memory) is a memory record: tokens, pages, per-layer linear records. What a forward
pass computed about it under some view is execution state and lives here:

- the writer state: Gated DeltaNet state and conv tail after the block's last token, under the view it
  was last written with (the next step of the same writer under the same view starts from it instead
  of composing the view again);
- the last logits: the logits after the block's last token, under that same view (a generation that
  starts right after a write samples from them instead of recomputing the last token).

Entries are keyed by view keys (`cothink.memory.block.view_key`: block ids, versions and lengths), so
an entry never answers for content that changed; the runner drops a block's entries when it truncates
or frees it so they do not outlive their use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cothink.execution.linear_state import LinearState
from cothink.memory.block import Block, view_key

ViewKey = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class WriterState:
    """Per linear layer (by slot), the state after the block under `view`."""

    view: ViewKey
    layers: list[LinearState]


@dataclass(frozen=True, slots=True)
class LastLogits:
    view: ViewKey
    logits: torch.Tensor  # [vocab] fp32


class ExecutionCache:
    """Writer states and last logits of a runner's blocks, by block id."""

    def __init__(self) -> None:
        self._writer: dict[int, WriterState] = {}
        self._logits: dict[int, LastLogits] = {}
        # entries set by the last step whose logits are still rows of that step's output tensor
        self._borrowed: list[tuple[int, LastLogits]] = []

    # ---- writer state --------------------------------------------------------------------------
    def writer_state(self, block: Block, view: ViewKey) -> WriterState | None:
        """The block's writer state if it was computed under exactly `view` (the view key before the
        next write: every block's id, version and read length, the writer's own length last)."""
        entry = self._writer.get(block.id)
        return entry if entry is not None and entry.view == view else None

    def writer_view(self, block: Block) -> ViewKey | None:
        """The view key the block's writer state was computed under, if any (for introspection)."""
        entry = self._writer.get(block.id)
        return entry.view if entry is not None else None

    def set_writer_state(self, block: Block, entry: WriterState) -> None:
        self._writer[block.id] = entry

    # ---- last logits ---------------------------------------------------------------------------
    def set_step_logits(self, entries: list[tuple[Block, LastLogits]]) -> None:
        """A step's last logits, as rows of the step's logits tensor (no copy). A row is copied out
        only if its entry is still there after the next step: most are replaced by then (decoding
        writers), and none keeps a whole step's tensor alive longer than one step."""
        for block, entry in entries:
            self._logits[block.id] = entry
        for block_id, entry in self._borrowed:  # the previous step's rows not replaced just now
            if self._logits.get(block_id) is entry:
                self._logits[block_id] = LastLogits(entry.view, entry.logits.clone())
        self._borrowed = [(block.id, entry) for block, entry in entries]

    def last_logits(self, prefix: list[Block]) -> torch.Tensor | None:
        """Logits after the last token of `prefix` (a view ending with a non-empty block) if the last
        write of that block computed them under this same view; else None."""
        if not prefix:
            return None
        entry = self._logits.get(prefix[-1].id)
        return entry.logits if entry is not None and entry.view == view_key(prefix) else None

    # ---- lifetime ------------------------------------------------------------------------------
    def drop(self, block: Block) -> None:
        """Forget everything about `block` (it was truncated or freed)."""
        self._writer.pop(block.id, None)
        self._logits.pop(block.id, None)

    def __len__(self) -> int:
        """Blocks with at least one entry."""
        return len(self._writer.keys() | self._logits.keys())
