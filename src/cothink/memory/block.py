"""Blocks: growing segments of model memory with block-local positions (docs/runtime.md, "Semantics")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class GrowingTensor:
    """Rows appended over time, stored with doubling capacity so decode appends stay O(1) amortised."""

    def __init__(self, width: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        self._buf = torch.empty((16, *width), dtype=dtype, device=device)
        self.length = 0

    @property
    def data(self) -> torch.Tensor:
        return self._buf[: self.length]

    def append(self, rows: torch.Tensor) -> None:
        need = self.length + rows.shape[0]
        if need > self._buf.shape[0]:
            grown = torch.empty(
                (max(need, 2 * self._buf.shape[0]), *self._buf.shape[1:]),
                dtype=self._buf.dtype,
                device=self._buf.device,
            )
            grown[: self.length] = self.data
            self._buf = grown
        self._buf[self.length : need] = rows
        self.length = need

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def clone(self, n: int | None = None) -> GrowingTensor:
        """A copy of the first n rows (all by default)."""
        copy = GrowingTensor(tuple(self._buf.shape[1:]), self._buf.dtype, self._buf.device)
        copy.append(self.data[:n])
        return copy


@dataclass(eq=False)
class LinearRecords:
    """What a block keeps for one Gated DeltaNet layer (docs/architecture.md, "Memory choices").

    Per token: the pre-conv [q|k|v] row, the log decay g and beta. These replay the block exactly
    after any predecessor (its first W-1 tokens re-read the predecessor's conv tail). For long
    blocks a dense summary [B | A] of the body (tokens W-1..covered-1) is cached as well, so a view
    composes them in O(K^2 V) instead of replaying them.
    """

    rows: GrowingTensor
    g: GrowingTensor
    beta: GrowingTensor
    summary: torch.Tensor | None = None
    summary_covers: int = 0  # block tokens covered by `summary` (head included in the count)

    def truncate(self, n: int) -> None:
        for t in (self.rows, self.g, self.beta):
            t.truncate(n)
        if self.summary_covers > n:
            self.summary, self.summary_covers = None, 0

    def clone(self, n: int) -> LinearRecords:
        """A copy of the records of the first n tokens (the summary only if it covers no more)."""
        keep = self.summary_covers <= n
        return LinearRecords(
            self.rows.clone(n),
            self.g.clone(n),
            self.beta.clone(n),
            self.summary if keep else None,
            self.summary_covers if keep else 0,
        )


@dataclass(eq=False)
class Block:
    """A growing segment of memory, written by one writer at a time, readable from any view.

    Attention keys are stored with RoPE at block-local positions 0..n-1. The view, not the block,
    decides where the block sits. `version` changes whenever existing content changes (truncate),
    which invalidates every cache keyed on it.
    """

    id: int
    name: str
    length: int = 0
    version: int = 0
    freed: bool = False
    tokens: list[int] = field(default_factory=list, repr=False)  # the token ids, for rewinds and replays
    pages: list[int] = field(default_factory=list, repr=False)
    linear: list[LinearRecords] = field(default_factory=list, repr=False)
    # (what forward passes computed about the block, e.g. its writer state, lives in the execution
    # layer's cache: cothink.execution.cache)
    owner: Any = field(default=None, repr=False, compare=False)  # the runner or engine that made it

    def truncate(self, n: int) -> None:
        """Rewind to the first n tokens (through the owner, which checks nobody is writing)."""
        self.owner.truncate(self, n)

    def __len__(self) -> int:
        return self.length

    @property
    def position_span(self) -> int:
        """How far the block advances positions in a view (one per text token)."""
        return self.length

    def __hash__(self) -> int:
        return self.id


def view_key(view: list[Block], lengths: list[int] | None = None) -> tuple:
    """Identity of a view's content: which blocks, in which order, how far each is read."""
    lengths = lengths if lengths is not None else [b.length for b in view]
    return tuple((b.id, b.version, n) for b, n in zip(view, lengths))
