"""Gated DeltaNet (and KDA) state of a view, composed block by block.

The same code serves Kimi's KDA layers: the mixer brings its geometry (`cfg`: heads, K, V, conv),
its `split`, `recurrence` and `affine_summary` (per-channel decays g [n, H, K] instead of per head).

See docs/architecture.md, "Memory choices for Gated DeltaNet blocks".

For each block in view order: its first W-1 tokens (the head) are recomputed against the conv tail
of what precedes it in this view, then its body is applied either as a cached dense summary
[B | A] or by replaying its stored rows. Exact relative to the blocks' stored per-layer inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cothink.memory.block import LinearRecords, SealedRecords
from cothink.models.transformer import GatedDeltaNet
from cothink.ops.gdn import apply_summary, causal_conv, compose


@dataclass(frozen=True, slots=True)
class LinearState:
    """Gated DeltaNet state [HV, K, V] (fp32) and conv tail [W-1, conv_dim] (the last W-1 pre-conv
    rows) at one point of a view."""

    state: torch.Tensor
    tail: torch.Tensor


def empty_state(mixer: GatedDeltaNet, dtype: torch.dtype, device) -> LinearState:
    g = mixer.cfg
    state = torch.zeros(g.num_v_heads, g.k_dim, g.v_dim, dtype=torch.float32, device=device)
    tail = torch.zeros(g.conv_kernel - 1, g.conv_dim, dtype=dtype, device=device)
    return LinearState(state, tail)


def run_tokens(
    mixer: GatedDeltaNet,
    history: torch.Tensor,
    rows: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv (after `history`, the W-1 preceding pre-conv rows) and delta rule over rows; (out, state).
    The layer's `recurrence` module computes it (the native backend's takes one C call for a single
    row)."""
    return mixer.recurrence(history, rows, mixer.conv_weight, g, beta, state)


def _body_summary(mixer: GatedDeltaNet, rec: LinearRecords, length: int) -> torch.Tensor:
    """Dense summary of tokens W-1..length-1, extended incrementally from what is cached."""
    w = mixer.cfg.conv_kernel - 1
    start = rec.summary_covers if rec.summary is not None else w
    rows = rec.rows.data
    q, k, v = mixer.split(causal_conv(rows[start - w : start], rows[start:length], mixer.conv_weight))
    piece = mixer.affine_summary(k, v, rec.g.data[start:length], rec.beta.data[start:length])
    rec.summary = piece if rec.summary is None else compose(rec.summary, piece)
    rec.summary_covers = length
    return rec.summary


def apply_block(
    mixer: GatedDeltaNet,
    rec: LinearRecords | SealedRecords,
    length: int,
    before: LinearState,
    dense_min_tokens: int,
) -> LinearState:
    """Advance (state, conv tail) over the first `length` tokens of a block."""
    if isinstance(rec, SealedRecords):
        return _apply_sealed(mixer, rec, length, before)
    w = mixer.cfg.conv_kernel - 1
    state, tail = before.state, before.tail
    rows, g, beta = rec.rows.data[:length], rec.g.data[:length], rec.beta.data[:length]
    head = min(w, length)
    _, state = run_tokens(mixer, tail, rows[:head], g[:head], beta[:head], state)
    if length > head:
        body = length - head
        if body >= dense_min_tokens and rec.summary_covers <= length:
            packed = rec.summary if rec.summary_covers == length else _body_summary(mixer, rec, length)
            state = apply_summary(packed, state)
        else:
            _, state = run_tokens(mixer, rows[:w], rows[w:], g[w:], beta[w:], state)
    new_tail = torch.cat((tail, rows), dim=0)[-w:] if w else tail
    return LinearState(state, new_tail)


def seal_records(mixer: GatedDeltaNet, rec: LinearRecords, length: int) -> LinearRecords | SealedRecords:
    """What a sealed block of `length` tokens keeps for this layer (see SealedRecords).

    A block whose records are no larger than the sealed form (a [HV, K, V+K] fp32 summary plus 2W-1
    token records; short blocks) keeps its records: sealing never makes a block bigger."""
    g = mixer.cfg
    w = g.conv_kernel - 1
    row_bytes = rec.rows.row_bytes + rec.g.row_bytes + rec.beta.row_bytes
    summary_bytes = g.num_v_heads * g.k_dim * (g.v_dim + g.k_dim) * 4
    if w == 0 or length < 2 * (w + 1) + 1 or length * row_bytes <= summary_bytes + (2 * w + 1) * row_bytes:
        return rec
    body_end = length - 1  # the summary stops before the last token, so L-1 stays readable
    if rec.summary is not None and rec.summary_covers == body_end:
        summary = rec.summary
    else:
        start_from = rec if rec.summary_covers <= body_end else LinearRecords(rec.rows, rec.g, rec.beta)
        scratch = LinearRecords(start_from.rows, start_from.g, start_from.beta, start_from.summary,
                                start_from.summary_covers)
        summary = _body_summary(mixer, scratch, body_end)
    rows, g, beta = rec.rows.data[:length], rec.g.data[:length], rec.beta.data[:length]
    window = slice(length - (w + 1), length)
    return SealedRecords(
        length=length,
        head_rows=rows[:w].clone(),
        head_g=g[:w].clone(),
        head_beta=beta[:w].clone(),
        summary=summary,
        window_rows=rows[window].clone(),
        window_g=g[window].clone(),
        window_beta=beta[window].clone(),
    )


def _apply_sealed(mixer: GatedDeltaNet, rec: SealedRecords, length: int, before: LinearState) -> LinearState:
    """A sealed block read at its full length L or at L-1: head, summary, then the last token."""
    if length not in (rec.length, rec.length - 1):
        raise ValueError(f"a sealed block of {rec.length} tokens is read at {rec.length} or {rec.length - 1}")
    w = mixer.cfg.conv_kernel - 1
    _, state = run_tokens(mixer, before.tail, rec.head_rows, rec.head_g, rec.head_beta, before.state)
    state = apply_summary(rec.summary, state)
    if length == rec.length:
        last = slice(w, w + 1)
        rows, g, beta = rec.window_rows, rec.window_g, rec.window_beta
        _, state = run_tokens(mixer, rows[:w], rows[last], g[last], beta[last], state)
        return LinearState(state, rec.window_rows[1:])
    return LinearState(state, rec.window_rows[:w])
