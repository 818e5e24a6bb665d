"""Multimodal RoPE positions of blocks (Qwen3.5, Qwen3-VL): the span rule, as pure functions.

transformers positions a sequence with one scalar counter `c` from 0: a text token gets (c, c, c) and
advances it by 1; a vision run (one image, or one frame group: a merged grid of H' x W' tokens) gets
(c, c + row, c + col) for its tokens in row-major order and advances it by max(H', W'). So the counter
after any prefix is the prefix's largest position + 1, on all three axes at once.

A block applies the same counter to its own tokens from 0: its **local positions** `pos3` [3, n]. Its
**span** after n tokens is max(pos3[:, :n]) + 1 (n for text; 2 + max(H', W') for an image wrapped by
vision start/end). A view places block j at the **offset** sum of the spans before it, the same scalar on
t, h and w; a token's absolute position is its local position + the offset. This equals transformers'
positions on the blocks' tokens concatenated in view order, for any order: moving a block adds the same
shift to every axis, so every rotary frequency sees a plain 1-D shift whichever axis owns it.

`mrope_cos_sin` gives the rotary angles of 3-D positions under the interleaved frequency layout; at
equal axes (every text token) it equals the 1-D rotary at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TextRun:
    """`length` text tokens (vision start/end and timestamp tokens included)."""

    length: int

    @property
    def tokens(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class VisionRun:
    """The placeholder tokens of one image or one frame group: a merged grid, row-major."""

    rows: int  # H' = patch rows / merge
    cols: int  # W' = patch columns / merge

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    @property
    def advance(self) -> int:
        """How far the run moves the counter."""
        return max(self.rows, self.cols)


Run = TextRun | VisionRun


def run_positions(start: int, runs: Sequence[Run]) -> tuple[torch.Tensor, int]:
    """Positions [3, tokens] (int64; rows t, h, w) of `runs` with the counter at `start`, and the counter
    after them. Appending to a block continues from its span: run_positions(span, new_runs)."""
    parts, c = [], start
    for run in runs:
        if isinstance(run, TextRun):
            parts.append(torch.arange(c, c + run.length).expand(3, -1))
            c += run.length
        else:
            r, q = torch.meshgrid(torch.arange(run.rows), torch.arange(run.cols), indexing="ij")
            parts.append(torch.stack([torch.full((run.tokens,), c), c + r.flatten(), c + q.flatten()]))
            c += run.advance
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long), c
    return torch.cat(parts, dim=1), c


def local_positions(runs: Sequence[Run]) -> tuple[torch.Tensor, int]:
    """A block's local positions [3, tokens] from its own counter at 0, and its span."""
    return run_positions(0, runs)


def span_at(pos3: torch.Tensor, n: int | None = None) -> int:
    """The span of a block read to length n (default: all of it): its largest local position + 1, 0 when
    empty. Prefixes may end inside a vision run; the span is still the prefix's maximum + 1."""
    n = pos3.shape[1] if n is None else n
    return int(pos3[:, :n].max()) + 1 if n > 0 else 0


def view_offsets(spans: Sequence[int]) -> list[int]:
    """Each block's offset in a view: the sum of the spans before it (applied to t, h and w)."""
    out, total = [], 0
    for s in spans:
        out.append(total)
        total += s
    return out


def mrope_axes(num_freqs: int, section: Sequence[int]) -> torch.Tensor:
    """Which axis (0 t, 1 h, 2 w) rotates each of the `num_freqs` frequencies under the interleaved layout:
    h for j % 3 == 1 and j < 3 * section[1], w for j % 3 == 2 and j < 3 * section[2], t otherwise."""
    j = torch.arange(num_freqs)
    axis = torch.zeros(num_freqs, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


def mrope_cos_sin(
    pos3: torch.Tensor, inv_freq: torch.Tensor, section: Sequence[int], scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [tokens, 2F] fp32 (rotate_half layout) of positions pos3 [3, tokens]; inv_freq [F]."""
    freqs = pos3.float()[:, :, None] * inv_freq.float()  # [3, tokens, F]
    axis = mrope_axes(inv_freq.numel(), section).to(pos3.device)
    freqs = freqs.gather(0, axis.expand(freqs.shape[1], -1)[None])[0]  # [tokens, F]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale
