"""How the fast path's linears run on a CPU: the kernel for each dtype and row count.

- bfloat16 on a CPU whose oneDNN has bfloat16 kernels: `PackedLinear`. `F.linear` on a plain
  bfloat16 weight reorders it for oneDNN on every call; a weight reordered once at load
  (`mkldnn._reorder_linear_weight`, as inductor's freezing pass does) halves a decode step's matmul
  time on an AVX-512-BF16 CPU (measured: a [49152, 576] lm_head GEMV 6.4 -> 3.4 ms) and gives
  bit-identical results, row by row independent of the batch (tests/models/test_fast_path.py).
- Otherwise float32 and bfloat16: `CpuLinear`, which picks the call by the number of rows
  (measured on an AMD EPYC Zen 3 with AVX2, 2 threads, `bench/linears.py`). Under the native
  execution backend its steps of a few rows run in cothink's C kernel instead
  (execution/native_modules.py `NativeCpuLinear`, swapped in when the runner is built):
  * float32, from 2 to SGEMM_TRANSPOSED_MAX_ROWS rows: y^T = W x^T (`torch.mm(W, x.t())`) instead
    of `F.linear`'s y = x W^T. Same products, other operand order: at 2-4 rows MKL's kernel for
    `F.linear` streams the weights at 6-7 GB/s, the other order at ~13 (as one row does); 1.3-1.4x
    faster up to 64 rows.
  * bfloat16 without bfloat16 hardware, from WIDEN_MIN_ROWS rows on: the product is float32 math
    in either case (`F.linear` in bfloat16 accumulates in float32 and rounds the result), but the
    bfloat16 GEMM runs at ~18 GFLOP/s there against ~100 for float32. So the weight is widened to
    float32 a slab of rows at a time (WIDEN_SLAB_ELEMENTS, a size that stays in cache; no second
    copy of the model), multiplied in float32 and the result rounded to bfloat16 once.
    Results agree with `F.linear` up to the order of the float32 sums: a bfloat16 rounding step
    apart on ~1e-4 of the outputs, so batch invariance holds up to float tolerance (docs/runtime.md,
    "Semantics"), not to the bit. Fewer rows stay on `F.linear`. int8 layers (models/quantize.py)
    widen their wide inputs the same way (`widened_matmul`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Prepacking applies to bfloat16 on a CPU whose oneDNN has bfloat16 kernels."""
    return (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class FastLinear(nn.Module):
    """A linear of the fast path (the model's head gives its float32 logits through
    `float_forward`, which a backend's module may compute in the product's own pass)."""

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`forward(x).float()`."""
        return self(x).float()


class PackedLinear(FastLinear):
    """y = x W^T (+ b) with W held in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # a plain attribute, not a buffer: opaque tensors have no storage for state_dict or .to()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def of(cls, other: PackedLinear) -> PackedLinear:
        """A PackedLinear sharing `other`'s packed weight and bias (no second reorder)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = other.out_features, other.in_features
        layer.packed = other.packed
        layer.register_buffer("bias", other.bias)
        return layer

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] bfloat16 weight (a copy: the packed one unpacked)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":  # not the fast path's input: plain math
            return self.plain_forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear on the dense weight in x's dtype (inputs the packed product does not take)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dense_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked bf16"


# rows up to which float32 runs as y^T = W x^T (at one row, and above this, F.linear is as fast)
SGEMM_TRANSPOSED_MAX_ROWS = 64
# rows from which a bfloat16 product is computed in float32 on CPUs without bfloat16 kernels
WIDEN_MIN_ROWS = 8
# elements of weight widened to float32 at a time (4 MiB: stays in the caches)
WIDEN_SLAB_ELEMENTS = 1 << 20


def _sgemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for float32 [M, K] x [N, K], in the operand order MKL runs fastest for M rows."""
    if 1 < x.shape[0] <= SGEMM_TRANSPOSED_MAX_ROWS:
        y = torch.mm(w, x.t()).t().contiguous()
        return y if bias is None else y.add_(bias)
    return F.linear(x, w, bias)


SlabFill = Callable[[torch.Tensor, int, int], None]  # fill(slab, a, b): weight rows a..b as float32


def widened_matmul(x: torch.Tensor, fill: SlabFill, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for bfloat16 x [M, K] and an [n, K] weight in float32 arithmetic: `fill` writes the
    weight's rows a..b as float32 into a slab of this thread's scratch, slab after slab; the float32
    result is rounded to bfloat16 once."""
    m, k = x.shape
    xf, scratch = x.float(), _scratch()
    rows = max(1, scratch.numel() // k)
    bias = None if bias is None else bias.float()
    transposed = m <= SGEMM_TRANSPOSED_MAX_ROWS  # as _sgemm: y^T = W x^T for few rows
    # few rows: y^T in float32 (small), rounded in one transposing pass; many rows: each slab's
    # columns rounded straight into the result (no float32 copy of a wide [M, n] output)
    acc = torch.empty(n, m) if transposed else torch.empty(m, n, dtype=x.dtype)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        slab = scratch[: (b - a) * k].view(b - a, k)
        fill(slab, a, b)
        if transposed:  # rows a..b of y^T are contiguous: the product lands in place
            torch.mm(slab, xf.t(), out=acc[a:b])
        else:
            acc[:, a:b] = F.linear(xf, slab, None if bias is None else bias[a:b])
    if not transposed:
        return acc
    y = acc.t() if bias is None else acc.t() + bias
    return torch.empty(y.shape, dtype=x.dtype).copy_(y)


def bfloat16_matmul(x: torch.Tensor, fill: SlabFill, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for bfloat16 x [M, K] on oneDNN's bfloat16 GEMM (a CPU with bfloat16 arithmetic):
    `fill` writes the whole [n, K] weight as bfloat16 into a temporary, then one GEMM. For quantized
    weights on prefill-sized inputs: the bfloat16 GEMM runs on the CPU's matrix units (AMX) where it
    has them, far faster than float32 math, for the price of the weight rounded to bfloat16. One
    GEMM over a temporary rather than cache-sized slabs: on the AMX VM the slabs' many smaller GEMMs
    made SmolLM2's 4-bit prefill slower."""
    weight = torch.empty(n, x.shape[1], dtype=torch.bfloat16)
    fill(weight, 0, n)
    return F.linear(x, weight, None if bias is None else bias.to(torch.bfloat16))


class CpuLinear(FastLinear):
    """y = x W^T (+ b) for float32 and bfloat16 weights on a CPU, by the row count (module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # parameters as before (the model's identity and size read them), and plain aliases for the
        # hot path: a module attribute lookup costs more than a small decode matmul's dispatch
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._w, self._b = self.weight.data, None if bias is None else self.bias.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._w, self._b
        if x.dtype != w.dtype or not x.is_cpu:  # not the fast path's input: plain math
            return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if w.dtype == torch.float32:
            y = _sgemm(rows, w, b)
        elif rows.shape[0] >= WIDEN_MIN_ROWS:
            y = widened_matmul(rows, lambda slab, a, b: slab.copy_(w[a:b]), self.out_features, b)
        else:
            y = F.linear(rows, w, b)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.dtype}"


_THREAD = threading.local()


def _scratch() -> torch.Tensor:
    """This thread's float32 slab for widening weights (one per thread: steps may run anywhere)."""
    slab = getattr(_THREAD, "slab", None)
    if slab is None:
        slab = _THREAD.slab = torch.empty(WIDEN_SLAB_ELEMENTS)
    return slab


def pack_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace every nn.Linear of a CPU model (after fusion) by the fast path's linear for `dtype`,
    in place: PackedLinear where oneDNN has bfloat16 kernels, CpuLinear for other float32 and
    bfloat16 models."""
    if can_pack(dtype, "cpu"):
        return replace_linears(model, PackedLinear)
    if dtype in (torch.float32, torch.bfloat16):  # CpuLinear keeps the weight: the parts stay views
        return replace_linears(model, CpuLinear, drop_parts=False)
    return model


# fused module -> the HF-named parts it replaces (models/transformer.py, fuse())
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}

LinearFactory = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]


def _part_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute name) of each HF-named part of every fused projection the model holds."""
    return [(module, name) for module in model.modules() for fused, names in _FUSED_PARTS.items()
            if getattr(module, fused, None) is not None for name in names]


def fused_parts(model: nn.Module) -> list[nn.Module]:
    """The HF-named parts of every fused projection still held (views of its weight that the fused
    forward does not call)."""
    return [part for module, name in _part_slots(model) if (part := getattr(module, name)) is not None]


def drop_fused_parts(model: nn.Module) -> None:
    """Set the HF-named parts of every fused projection to None (the fused forward does not use
    them; they are views that would keep the dense fused weight alive)."""
    for module, name in _part_slots(model):
        setattr(module, name, None)


def replace_linears(model: nn.Module, make: LinearFactory, *, drop_parts: bool = True) -> nn.Module:
    """Replace every nn.Linear of `model` by make(weight, bias), in place. With `drop_parts`, the
    HF-named parts of fused projections are dropped first (so each weight is converted once, through
    the fused module, and no dense copy of it stays alive); without, they are replaced too and stay
    views of the fused weight (for a `make` that keeps the weight tensor it is given)."""
    if drop_parts:
        drop_fused_parts(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child.weight, child.bias))
    return model
