"""Blocks: growing segments of model memory with block-local positions (docs/runtime.md, "Semantics")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class _Storage:
    """One buffer of rows and the GrowingTensors that read it (forks share it copy-on-write)."""

    __slots__ = ("buf", "users")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.users: list[GrowingTensor] = []


class GrowingTensor:
    """Rows appended over time, stored with doubling capacity so decode appends stay O(1) amortised.

    `share(n)` makes a copy-on-write view of the first n rows: both sides read one buffer until one
    appends where another sharer still reads (its first divergent append), which then copies.
    """

    def __init__(self, width: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        self._attach(_Storage(torch.empty((16, *width), dtype=dtype, device=device)))
        self.length = 0

    def _attach(self, storage: _Storage) -> None:
        self._storage = storage
        storage.users.append(self)

    def _detach(self) -> None:
        self._storage.users.remove(self)

    @property
    def _buf(self) -> torch.Tensor:
        return self._storage.buf

    @property
    def data(self) -> torch.Tensor:
        return self._buf[: self.length]

    @property
    def row_bytes(self) -> int:
        return self._buf[0].numel() * self._buf.element_size()

    @property
    def shared(self) -> bool:
        return len(self._storage.users) > 1

    def storage_key(self) -> int:
        """Identity of the buffer (for counting shared buffers once)."""
        return id(self._storage)

    def stored_rows(self) -> int:
        """Rows of the buffer some sharer reads (what it holds for all of them)."""
        return max(u.length for u in self._storage.users)

    def diverges_on_append(self) -> bool:
        """Would the next append copy the buffer (another sharer reads past this one's end)?"""
        return any(u.length > self.length for u in self._storage.users if u is not self)

    def append(self, rows: torch.Tensor) -> None:
        need = self.length + rows.shape[0]
        # Another sharer reads rows this append would overwrite: copy first (copy-on-write).
        diverges = self.diverges_on_append()
        if diverges or need > self._buf.shape[0]:
            # a diverging copy gets a little headroom; a private buffer doubles
            capacity = (5 * need) // 4 if diverges else 2 * self._buf.shape[0]
            grown = torch.empty(
                (max(need, capacity, 16), *self._buf.shape[1:]),
                dtype=self._buf.dtype,
                device=self._buf.device,
            )
            grown[: self.length] = self.data
            self._detach()
            self._attach(_Storage(grown))
        self._buf[self.length : need] = rows
        self.length = need

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def share(self, n: int | None = None) -> GrowingTensor:
        """A copy-on-write view of the first n rows (all by default): no rows are copied now."""
        view = GrowingTensor.__new__(GrowingTensor)
        view._attach(self._storage)
        view.length = self.length if n is None else min(n, self.length)
        return view

    def release(self) -> None:
        """Stop reading the buffer (the block was freed); other sharers keep it."""
        if self in self._storage.users:
            self._detach()
        self.length = 0

    def clone(self, n: int | None = None) -> GrowingTensor:
        """A private copy of the first n rows (all by default)."""
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

    def share(self, n: int) -> LinearRecords:
        """Copy-on-write records of the first n tokens (the summary only if it covers no more)."""
        keep = self.summary_covers <= n
        return LinearRecords(
            self.rows.share(n),
            self.g.share(n),
            self.beta.share(n),
            self.summary if keep else None,
            self.summary_covers if keep else 0,
        )

    def release(self) -> None:
        for t in (self.rows, self.g, self.beta):
            t.release()
        self.summary, self.summary_covers = None, 0

    def parts(self) -> list[GrowingTensor]:
        return [self.rows, self.g, self.beta]


@dataclass(eq=False)
class SealedRecords:
    """What a sealed block keeps for one Gated DeltaNet layer: only what reading it needs.

    For a block of `length` L tokens and conv kernel W (w = W-1): the head records (tokens 0..w-1,
    recomputed against each predecessor's conv tail), the dense summary [B | A] of tokens w..L-2,
    and the window records of the last W tokens (L-W..L-1: the last token is replayed after the
    summary, and the window's rows give the conv tail after L-1 or L tokens). Its size does not
    depend on L. A block is read at its full length or, for the logits after its last token, at L-1.
    """

    length: int
    head_rows: torch.Tensor  # [w, conv_dim]
    head_g: torch.Tensor  # [w, HV] fp32
    head_beta: torch.Tensor
    summary: torch.Tensor  # [HV, K, V + K] fp32: tokens w..L-2
    window_rows: torch.Tensor  # [W, conv_dim]: tokens L-W..L-1
    window_g: torch.Tensor
    window_beta: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.head_rows, self.head_g, self.head_beta, self.summary,
            self.window_rows, self.window_g, self.window_beta,
        ]

    def release(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class VisionSpan:
    """The placeholder tokens of one image or one frame group in a block: a merged grid of `rows` x
    `cols` tokens, row-major, from block token `start` (models/mrope.py states the position rule)."""

    start: int
    rows: int
    cols: int

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    @property
    def stop(self) -> int:
        return self.start + self.tokens

    @property
    def advance(self) -> int:
        """How far the run moves the block's position counter."""
        return max(self.rows, self.cols)

    def cuts(self, n: int) -> bool:
        """Whether keeping the first n tokens would cut this image inside its vision-start ..
        vision-end tokens (the tokens just before `start` and at `stop`)."""
        return self.start - 1 < n <= self.stop


def span_at(runs: list[VisionSpan], n: int) -> int:
    """How many positions the first n tokens of a block with these vision runs span: their largest
    local position + 1. A text token advances the counter by one, a whole run by max(rows, cols); a
    prefix that ends inside a run reaches its largest row or column so far."""
    c = idx = 0
    for run in runs:
        if n <= run.start:
            break
        c += run.start - idx
        if n < run.stop:  # inside the run: tokens 0..k-1 of a row-major grid
            k = n - run.start
            return c + max((k - 1) // run.cols, min(k, run.cols) - 1) + 1
        c, idx = c + run.advance, run.stop
    return c + max(0, n - idx)


def local_positions(runs: list[VisionSpan], start: int, stop: int) -> torch.Tensor:
    """Local 3-D positions [3, stop - start] (int64; rows t, h, w) of block tokens start..stop-1: a
    text token at counter c gets (c, c, c); a run's token (row r, column q) gets (c, c + r, c + q)."""
    parts: list[torch.Tensor] = []

    def text(c: int, a: int, b: int) -> None:  # tokens a..b-1 are text, token a at counter c
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            parts.append(torch.arange(c + lo - a, c + hi - a).expand(3, -1))

    c = idx = 0
    for run in runs:
        if run.start >= stop:
            break
        text(c, idx, run.start)
        c += run.start - idx
        lo, hi = max(run.start, start), min(run.stop, stop)
        if lo < hi:
            k = torch.arange(lo - run.start, hi - run.start)
            parts.append(torch.stack([torch.full_like(k, c), c + k // run.cols, c + k % run.cols]))
        c, idx = c + run.advance, run.stop
    text(c, idx, max(stop, idx))
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


@dataclass(eq=False)
class Block:
    """A growing segment of memory, written by one writer at a time, readable from any view.

    Attention keys are stored with RoPE at block-local positions: 0..n-1 for text; a block holding
    images or frame groups (`vision`) gives each token its local 3-D position (`local_positions`).
    The view, not the block, decides where the block sits: at the sum of the spans before it.
    `version` changes whenever existing content changes (truncate), which invalidates every cache
    keyed on it.
    """

    id: int
    name: str
    length: int = 0
    version: int = 0
    freed: bool = False
    tokens: list[int] = field(default_factory=list, repr=False)  # the token ids, for rewinds and replays
    pages: list[int] = field(default_factory=list, repr=False)
    linear: list[LinearRecords | SealedRecords] = field(default_factory=list, repr=False)
    sealed: bool = False  # immutable: extend, truncate and fork are refused (BlockSealedError)
    pinned: bool = False  # never spilled to disk
    # the placeholder runs of its images and frame groups, in order (empty for a text block)
    vision: list[VisionSpan] = field(default_factory=list, repr=False)
    last_read: int = 0  # logical clock of the last submitted work that read it (spill order)
    spilled: Path | None = field(default=None, repr=False)  # its memory is in this file, not resident
    spilled_bytes: int = 0  # the block memory that file holds
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
        """How far the block advances positions in a view: its largest local position + 1 (its
        length for text; an image adds max(rows, cols) for its grid)."""
        return span_at(self.vision, self.length) if self.vision else self.length

    def span_at(self, n: int) -> int:
        """The span of the block's first n tokens (a view reading a prefix of it)."""
        return span_at(self.vision, n) if self.vision else n

    @property
    def readable_length(self) -> int:
        """How much of the block other items read: all of it, except an image being written, which
        they see only once whole (up to its vision-start token until then)."""
        run = self.vision_run_cut_by(self.length) if self.vision else None
        return self.length if run is None else run.start - 1

    def vision_run_cut_by(self, n: int) -> VisionSpan | None:
        """The image or frame group that keeping only the first n tokens would cut, if any."""
        return next((run for run in self.vision if run.cuts(n)), None)

    def __hash__(self) -> int:
        return self.id


def view_key(view: list[Block], lengths: list[int] | None = None) -> tuple:
    """Identity of a view's content: which blocks, in which order, how far each is read."""
    lengths = lengths if lengths is not None else [b.length for b in view]
    return tuple((b.id, b.version, n) for b, n in zip(view, lengths))
