"""The attention backend seam: which kernels attend a step's queries over its key runs.

A step (execution/step.py) gathers, per item, the key runs its view exposes (each block before the
writer, the writer's old tokens, this step's own tokens as a causal run) and asks the backend for
partial attentions with their log-sum-exp, then merges them. Decode items (one query row each) are
batched: runs several of them read go through `run` with all readers' queries, the rest through
`padded`, and `merge_grouped` merges each item's partials.

The runner picks one backend at construction (`ModelRunner(..., attention_backend=...)`):

- "torch": today's CPU path: the CPU flash kernel per run (math fallback off CPU), one padded batch
  for decode runs, the LSE merges of cothink.ops.attention.
- "reference": the plain, slow math (float64 scores, per-run loops, explicit merges); tests check the
  fast paths against it.
- "native": the "torch" path, except that decode-sized work runs in cothink's fused C kernels
  (cothink/ops/native.py): this step's keys are rotated and stored in one call per layer, and
  single-query items whose step reads at most `NATIVE_DECODE_MAX_KEYS` keys attend in one call
  (query rotated per run, one softmax over the runs). Above that the torch kernels, which use every
  thread, are faster.
- "auto": "native" on a CPU where the kernels build, else "torch" (GPU kernels will plug in here).
"""

from __future__ import annotations

from typing import Protocol

import torch

from cothink.errors import InvalidParameterError
from cothink.ops import native
from cothink.ops.attention import (
    merge_grouped,
    merge_partials,
    padded_attention,
    partial_attention,
    reference_merge,
    reference_partial_attention,
)

BACKEND_NAMES = ("auto", "torch", "native", "reference")

# Keys (per query head, summed over a step's decode items) up to which the fused decode attention
# beats the two-thread torch kernels plus their dispatch (`bench/decode_attention.py`: whole SmolLM2
# decode steps of N items sharing a context, 2-core AMD EPYC Zen 3. Session 8, the kernel on one
# thread, no fused step: torch / native step time 1.3-2.8x up to 16,416 keys, 1.25-1.29x at 8,320, 1.0
# at 32,832, 0.74-0.78 at 65,664: the torch path reads a shared run once for all its readers, the
# kernel once per reader. Session 9, with the fused step and its helper threads: 2.0-4.9x up to
# 16,416 keys at N <= 8; larger sizes not measured again, so the limit stays).
NATIVE_DECODE_MAX_KEYS = 16384


class AttentionBackend(Protocol):
    """Attention of queries over key runs; every result is fp32, LSE natural-log."""

    name: str

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] over one run k, v [L, Hkv, D] -> (out [T, Hq, D], lse [T, Hq]).
        `causal`: T == L and row t sees keys 0..t."""
        ...

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
        """One item's partials over disjoint runs -> its attention output [T, Hq, D]."""
        ...

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query row per run: q [R, Hq, D], k, v [R, L, Hkv, D], valid [R, L] (>= 1 per row)
        -> (out [R, Hq, D], lse [R, Hq])."""
        ...

    def merge_grouped(
        self, out: torch.Tensor, lse: torch.Tensor, owner: torch.Tensor, groups: int
    ) -> torch.Tensor:
        """Partials of many rows -> [groups, Hq, D]: rows with the same owner merge together."""
        ...


class TorchAttention:
    """The CPU torch path: flash kernel per run, a padded batch for decode, vectorised merges."""

    name = "torch"

    def run(self, q, k, v, scale, causal=False):
        return partial_attention(q, k, v, scale, causal)

    def merge(self, outs, lses):
        return merge_partials(outs, lses)

    def padded(self, q, k, v, valid, scale):
        return padded_attention(q, k, v, valid, scale)

    def merge_grouped(self, out, lse, owner, groups):
        return merge_grouped(out, lse, owner, groups)


class NativeAttention(TorchAttention):
    """The torch path with decode-sized work in fused C kernels (cothink.ops.native)."""

    name = "native"

    def decode_plan(
        self, runs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], rows: list[int],
        pool: torch.Tensor,
    ) -> native.DecodePlan | None:
        """A plan for the fused decode attention of these items, or None where the torch kernels
        are the better choice (too many keys) or cannot be matched (dtype, head size: a multiple
        of 16, as every released model's)."""
        if pool.dtype not in native.DTYPES or pool.shape[-1] % 16:
            return None
        if sum(slots.numel() for item in runs for slots, _, _ in item) > NATIVE_DECODE_MAX_KEYS:
            return None
        return native.DecodePlan(rows, runs)

    def can_store(self, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor) -> bool:
        """Whether store_kv can write this step's k, v [T, H, D] into pool [S, H, D]."""
        d = k.shape[-1]
        return (
            k.dtype == v.dtype == pool.dtype and native.supports(k) and native.supports(v)
            and k.stride(1) == d and v.stride(1) == d and pool.is_contiguous()
        )


class ReferenceAttention:
    """The plain math, one run and one group at a time: slow, obviously correct."""

    name = "reference"

    def run(self, q, k, v, scale, causal=False):
        return reference_partial_attention(q, k, v, scale, causal)

    def merge(self, outs, lses):
        return reference_merge(outs, lses)

    def padded(self, q, k, v, valid, scale):
        parts = [reference_partial_attention(q[r : r + 1], k[r][valid[r]], v[r][valid[r]], scale)
                 for r in range(q.shape[0])]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])

    def merge_grouped(self, out, lse, owner, groups):
        merged = []
        for g in range(groups):
            rows = (owner == g).nonzero().flatten().tolist()
            merged.append(reference_merge([out[r] for r in rows], [lse[r] for r in rows]))
        return torch.stack(merged)


def select_backend(name: str | AttentionBackend, device: torch.device | str) -> AttentionBackend:
    """The backend for `name` on `device`, chosen once per runner. An object passes through."""
    if not isinstance(name, str):
        return name
    if name not in BACKEND_NAMES:
        raise InvalidParameterError(
            f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}", param="attention_backend"
        )
    if name == "reference":
        return ReferenceAttention()
    on_cpu = torch.device(device).type == "cpu"
    if name == "native":
        if not (on_cpu and native.available()):
            raise InvalidParameterError(
                "attention_backend 'native' needs a CPU device and cothink's C kernels, which are "
                "switched off (COTHINK_NATIVE=0) or could not be built (no C compiler?)",
                param="attention_backend",
            )
        return NativeAttention()
    if name == "auto" and on_cpu and native.available():
        return NativeAttention()
    # the torch path (its kernel falls back to the math off CPU)
    return TorchAttention()
