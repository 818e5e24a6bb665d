"""The native backend's modules: cothink's C kernels (ops/native.py) in place of plain torch modules.

A decode step on a CPU is bound by dispatching small torch ops, not by their arithmetic (an RMSNorm of
one row is eight ops, ~18 us; one C call does it). When a runner is built with the native execution
backend, `use_native_modules` replaces, in a model whose projections are fused (the fast path), each
plain module by its native subclass here, sharing its parameters: the norms (with the residual add
before them, and per head for the q/k norms), SiLU x up, the attention output gate, Gated DeltaNet's
gates, output norm and a decoding token's conv + delta rule, and the linears (`NativeCpuLinear`,
`NativeInt8Linear`, `NativeInt4Linear`; oneDNN-packed bfloat16 ones, `NativePackedLinear`, where
the C kernel has the CPU's bfloat16 dot products, unless COTHINK_BF16_DECODE=0). Each takes its
kernel where the input is one the kernel reads and otherwise runs the plain module's torch code;
the kernels make the torch path's roundings to the model dtype (tests/ops/test_native.py; 4-bit
products: within float32 rounding, models/quant4.py).
`use_torch_modules` puts the plain modules back. The eager modules (`fast=False`) are never replaced.

NATIVE_MAX_ROWS: rows up to which the C linear runs a product (and a decode step can take the fused
decode step, execution/fused_decode.py); a bfloat16, int8 or 4-bit weight in pairs takes any rows
(PAIRS_MAX_ROWS). Measured on a 2-core AMD EPYC Zen 3 with AVX2
(`bench/linears.py`): each weight element is read once per 8 rows, bfloat16 widened in registers,
float32 sums in a fixed order per output (a row's result is the same to the bit in any batch up to
this size); against `F.linear`, bfloat16 1.1x at one row and 2.0-3.7x at 2-8 rows, float32 1.7x and
2.1-3.0x; at 16-32 rows about even for the linears alone, and the decode step gains as a whole from
the fused step around them.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from functools import cache

import torch
from torch import nn

from cothink.models.config import GDNConfig
from cothink.models.packing import CpuLinear, PackedLinear, fused_parts
from cothink.models.quant4 import Int4Linear
from cothink.models.quantize import Int8Linear
from cothink.models.transformer import (
    CausalLM,
    DecayGates,
    DeltaRecurrence,
    GatedRMSNorm,
    RMSNorm,
    SigmoidGate,
    SiluMul,
)
from cothink.ops import native
from cothink.ops.gdn import L2NORM_EPS

NATIVE_MAX_ROWS = 32
# Rows up to which a oneDNN-packed bfloat16 linear takes the C kernel on its plain weight
# (NativePackedLinear where the weight is not in pairs: AMX tiles, or an output count not a multiple of
# PAIR_TILE): oneDNN's product is faster beyond. Measured on a 2-core AMD EPYC Zen 4 (SmolLM2's shapes,
# C / oneDNN time): 0.7-1.2x at 1-2 rows, 0.9-1.3x at 4, 2-5x at 8-32; up to 4 the fused step around
# the kernel wins the dispatch back. A weight in pairs (`native.pack_pairs`) takes PAIRS_MAX_ROWS.
PACKED_NATIVE_MAX_ROWS = 4
# A weight in pairs takes every product in C, prefill chunks too. bfloat16 (native.c WT_BF16P): from
# 24 rows on as a GEMM of six rows by 64 outputs (`pairs_wide_tasks`), each row's result the same to the
# bit as in a decode step; SmolLM2's products 1.2x oneDNN's packed GEMM at 48 rows, 1.02-1.04x at 512
# (2-core Zen 4, docs/benchmarks.md). int8 or 4-bit (8-bit activations on VNNI: WT_INT8P, WT_Q4P), with
# the same 8-bit activations as the decode: 30 SmolLM2 4-bit layers' products at 512 rows 212 ms
# against 277 for the dequantized weight in oneDNN's bfloat16 GEMM, at 64 rows 30 against 61. (A
# float32 weight in tiles does not: beyond NATIVE_MAX_ROWS its products stay on the plain path, equal
# to it to the bit; NativeCpuLinear.)
PAIRS_MAX_ROWS = 1 << 62


class NativeRMSNorm(RMSNorm):
    """RMSNorm of 2-D rows (with the residual add before it) or of each head of [T, heads, D] (the
    q/k norms, on views of the q/k/v projection) in one C call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x):
            if x.dim() == 3:
                return native.head_rms_norm(x, self.weight, self.eps, self.zero_centred)
            return native.rms_norm(x, self.weight, self.eps, self.zero_centred)[0]
        return super().forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fits(x) and x.dim() == 2 and native.supports(residual):
            return native.rms_norm(x, self.weight, self.eps, self.zero_centred, residual)
        return super().add_forward(x, residual)

    def _fits(self, x: torch.Tensor) -> bool:
        return x.dim() in (2, 3) and x.dtype == self.weight.dtype and native.supports(x)


class NativeGatedRMSNorm(GatedRMSNorm):
    """Gated DeltaNet's output norm in one C call."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # x [T, heads, dim] contiguous; z of the same shape, each token's heads contiguous (a slice
        # of the fused input projection's rows)
        if (
            x.dim() == 3 and x.is_contiguous() and z.shape == x.shape
            and z.stride(2) == 1 and z.stride(1) == x.shape[2]
            and x.dtype == z.dtype == self.weight.dtype and native.supports(x) and native.supports(z)
        ):
            return native.gated_rms_norm(x, z, self.weight, self.eps)
        return super().forward(x, z)


class NativeSiluMul(SiluMul):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and native.supports(gate_up):
            return native.silu_mul(gate_up)
        return super().forward(gate_up)


class NativeSigmoidGate(SigmoidGate):
    def forward(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if gate.dtype == out.dtype and native.supports(gate) and out.is_contiguous():
            return native.sigmoid_gate(out, gate)
        return super().forward(out, gate)


class NativeDecayGates(DecayGates):
    def forward(
        self, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # columns of the fused input projection's rows: one row stride, the last dim contiguous
        if (
            b.dim() == a.dim() == 2 and b.stride(0) == a.stride(0)
            and native.supports(b) and native.supports(a)
            and all(p.dtype == b.dtype == a.dtype and p.is_contiguous() for p in (a_log, dt_bias))
        ):
            return native.gdn_gates(b, a, a_log, dt_bias)
        return super().forward(b, a, a_log, dt_bias)


class NativeDeltaRecurrence(DeltaRecurrence):
    """A single row (a decoding coroutine's token) in one C call (`native.gdn_token`: the same math
    to float rounding) instead of ~30 small torch ops; more rows take the torch path."""

    def forward(
        self, history: torch.Tensor, rows: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rows.shape[0] == 1 and self._fits(history, rows, conv_weight, g, beta, state):
            return native.gdn_token(history, rows, conv_weight, g, beta, state, token_shape(self.cfg))
        return super().forward(history, rows, conv_weight, g, beta, state)

    def _fits(self, history: torch.Tensor, row: torch.Tensor, conv: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor) -> bool:
        """Rows of a kernel dtype (the conv weight's), float32 gates and state, laid out as it reads them."""
        return (
            native.supports(row) and native.supports(history) and row.is_contiguous()
            and conv.dtype == row.dtype == history.dtype and conv.is_contiguous()
            and history.shape[0] == self.cfg.conv_kernel - 1
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (g, beta, state))
        )


@cache
def token_shape(g: GDNConfig) -> native.GdnShape:
    """The sizes the C kernels read of a Gated DeltaNet layer (one per model)."""
    return native.GdnShape(g.num_k_heads, g.num_v_heads, g.k_dim, g.v_dim, L2NORM_EPS)


class NativeLinear:
    """A linear whose products of up to NATIVE_MAX_ROWS rows run in cothink's C kernel (`native.linear`;
    its operands from `operands`), and whose logits come out of that call in float32 (`float_forward`).
    Mixed into the fast path's linears (`NativeCpuLinear`, `NativeInt8Linear`, `NativeInt4Linear`); the
    fused decode step (execution/fused_decode.py) reads their operands."""

    out_features: int  # the plain module's
    _native_rows = 0  # set by `_fit_native` once the operands exist
    _native_dtype: torch.dtype | None = None  # the activations' dtype the kernel takes (None: any of its)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, int8 row scales or None, bias or None) as the C kernel reads them."""
        raise NotImplementedError

    @property
    def native_rows(self) -> int:
        """Rows up to which this linear runs in the C kernel (0: never; its weight does not fit it)."""
        return self._native_rows

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`forward(x).float()` (the logits), in one pass where the C kernel takes x: a separate
        widening pass over a bfloat16 step's [rows, vocab] output wakes torch's idle OpenMP thread
        (measured ~0.6 ms of a ~20 ms single-stream decode step)."""
        if x.dim() == 2 and self._takes_native(x):
            return self._native(x, float_out=True)
        return self(x).float()

    def takes_dtype(self, dtype: torch.dtype) -> bool:
        """Whether the C kernel takes this weight with activations of `dtype`."""
        return dtype == self._native_dtype if self._native_dtype is not None else dtype in native.DTYPES

    def _fit_native(self, activations: torch.dtype | None, rows: int = NATIVE_MAX_ROWS) -> None:
        """Take products of up to `rows` rows in C, where the kernel reads these operands."""
        w, scale, b = self.operands()
        self._native_dtype = activations
        self._native_rows = rows if native.linear_fits(w, b, scale) else 0

    def _takes_native(self, rows: torch.Tensor) -> bool:
        """Whether the C kernel runs this product (2-D CPU rows of a dtype it takes for this weight)."""
        return (
            rows.shape[0] <= self._native_rows and rows.is_cpu and rows.stride(-1) == 1
            and self.takes_dtype(rows.dtype) and native.available()
        )

    def _native_rows_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """The C kernel's product for x of any leading dimensions, or None where it does not take x
        (x's dtype included: `_takes_native`)."""
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not self._takes_native(rows):
            return None
        y = self._native(rows)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def _native(self, rows: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        w, scale, b = self.operands()  # n: the outputs, which a float32 weight's padded tiles do not say
        return native.linear(rows, w, b, scale=scale, float_out=float_out, n=self.out_features)


class NativeCpuLinear(NativeLinear, CpuLinear):
    """CpuLinear with its products of up to NATIVE_MAX_ROWS rows in the C kernel. A float32 weight that
    `native.takes_f32_tiles` (AVX-512, unless COTHINK_F32_TILES=0) keeps a copy in tiles for them
    (`native.pack_f32_tiles`: a GEMM tile, 1.8-1.9x the plain layout's C products at 8-32 rows, level at
    one): the linears' memory twice. Wider products (prefill chunks) stay on the plain path, bit-identical
    to it as before: tiles there measured 1.1-1.7x MKL's at 64-512 rows, within float32 rounding of it,
    not to the bit (docs/benchmarks.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, bias)
        self._tiles = native.pack_f32_tiles(self._w) if native.takes_f32_tiles(self._w) else None
        self._fit_native(self._w.dtype)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self._w if self._tiles is None else self._tiles, None, self._b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._native_rows_of(x)
        return super().forward(x) if y is None else y


class NativePackedLinear(NativeLinear, PackedLinear):
    """PackedLinear with its products of a few rows in the C kernel (limits below), where that
    has the CPU's bfloat16 dot products (AVX-512 BF16 pairs or AMX tiles; `native.use_bf16_decode`,
    unless COTHINK_BF16_DECODE=0): no per-call dispatch, so a decode step can take the fused step (SmolLM2
    bfloat16 decode 1.5x on an AMD EPYC Zen 4, docs/benchmarks.md). Where `native.bf16_pairs`
    (AVX-512 BF16 without AMX tiles) it holds the weight in pairs (`native.pack_pairs`) in place of
    oneDNN's packed one, and takes every product of bfloat16 rows (PAIRS_MAX_ROWS: steps of many
    coroutines take the fused step, and prefill chunks the same sums as a decode step); inputs the C
    kernel does not take (float32 rows, a strided last dimension) run F.linear on the weight unpacked.
    Else it keeps the plain weight beside oneDNN's packed one (the linears' memory twice,
    docs/runtime.md) for products of up to PACKED_NATIVE_MAX_ROWS rows, oneDNN's beyond."""

    @classmethod
    def of(cls, other: PackedLinear) -> NativePackedLinear:
        layer = super().of(other)
        weight = other.dense_weight().contiguous()  # the weight, exactly: a reorder is a copy
        if native.takes_pairs(weight):
            layer._w = native.pack_pairs(weight)
            layer._fit_native(torch.bfloat16, PAIRS_MAX_ROWS)
            layer.packed = None  # the pairs take its products: one copy of the weight
        else:
            layer._w = weight
            layer._fit_native(torch.bfloat16, PACKED_NATIVE_MAX_ROWS)
        return layer

    def plain(self) -> PackedLinear:
        """The PackedLinear this stands in for (`use_torch_modules`): the packed weight, packed again
        from the pairs where this holds none."""
        if self.packed is None:
            return PackedLinear(self.dense_weight(), self.bias)
        return PackedLinear.of(self)

    def dense_weight(self) -> torch.Tensor:
        return native.unpack_pairs(self._w) if self.packed is None else super().dense_weight()

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self._w, None, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._native_rows_of(x)
        if y is not None:
            return y
        return self.plain_forward(x) if self.packed is None else super().forward(x)


class NativeInt8Linear(NativeLinear, Int8Linear):
    """Int8Linear with its products of up to NATIVE_MAX_ROWS rows in the C kernel (input rounded to
    bfloat16, each output's sum times its scale rounded as torch's int8 kernel does, bias included); in
    pairs, with 8-bit activations, every product (models/quantize.py)."""

    _pairs: torch.Tensor | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, bias)
        self._fit()

    @classmethod
    def of(cls, other: Int8Linear) -> NativeInt8Linear:
        layer = super().of(other)
        layer._fit()
        return layer

    def _fit(self) -> None:
        """Where `native.takes_pairs` (AVX-512 BF16 and VNNI; K a multiple of 32), the C kernel reads a
        copy of the weight in pairs (`pack_pairs`) and takes x as 8-bit codes per group of 32, every
        product, prefill chunks too (32 coroutines ~1.3x), the int8 weight itself staying for the other
        inputs (the int8 weights twice); else the int8 weight, up to NATIVE_MAX_ROWS rows."""
        bias_dtype = None if self.bias is None else self.bias.dtype  # C reads the bias in x's dtype
        if native.takes_pairs(self.weight_int8):
            self._pairs = native.pack_pairs(self.weight_int8)
            self._fit_native(bias_dtype, PAIRS_MAX_ROWS)
        else:
            self._fit_native(bias_dtype)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.weight_int8 if self._pairs is None else self._pairs, self.scale, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._takes_native(rows):
            return self._native(rows).view(*x.shape[:-1], self.out_features)
        return super().forward(x)


class NativeInt4Linear(NativeLinear, Int4Linear):
    """Int4Linear with its products of up to NATIVE_MAX_ROWS rows in the C kernel (the dequantized
    product within float32 rounding, models/quant4.py; in pairs, with 8-bit activations, within the
    bound that adds their rounding; bias included, rounded once)."""

    _pairs: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, bias)
        self._fit(None, False)

    @classmethod
    def of(cls, other: Int4Linear, activations: torch.dtype | None = None,
           half_scales: bool = False) -> NativeInt4Linear:
        """A native layer holding `other`'s weights; `activations`: the model dtype, where known;
        `half_scales`: its pairs' scales as halves (every scale and offset one exactly)."""
        layer = super().of(other)
        layer._fit(activations, half_scales)
        return layer

    def _fit(self, activations: torch.dtype | None, half_scales: bool) -> None:
        """For bfloat16 activations where `native.bf16_pairs`, the C kernel reads a copy of the weight in
        pairs (`pack_q4_pairs`: tiles of outputs along the lanes, no horizontal sums, the activations as
        8-bit codes; 32 coroutines about 2.5x as fast as on the packed weight; with half scales a sixth
        fewer bytes), the packed weight itself staying for the
        dequantized GEMM of wider products (the 4-bit weights twice). Else the packed weight, for either
        dtype."""
        if activations == torch.bfloat16 and native.takes_pairs(self.weight_packed) and (
                self.bias is None or self.bias.dtype == torch.bfloat16):
            self._pairs = native.pack_q4_pairs(self.weight_packed, self.weight_scale, half_scales)
            self._fit_native(torch.bfloat16, PAIRS_MAX_ROWS)
        else:  # the C kernel reads the bias in x's dtype
            self._fit_native(None if self.bias is None else self.bias.dtype)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        weight, scale = (self.weight_packed, self.weight_scale) if self._pairs is None else self._pairs
        return weight, scale, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._takes_native(rows):
            return self._native(rows).view(*x.shape[:-1], self.out_features)
        return super().forward(x)


def _norm(cls: type[RMSNorm]) -> Callable[[RMSNorm], RMSNorm]:
    def make(norm: RMSNorm) -> RMSNorm:
        new = cls(norm.weight.shape[0], norm.eps, norm.zero_centred)
        new.weight = norm.weight
        return new

    return make


def _gated_norm(cls: type[GatedRMSNorm]) -> Callable[[GatedRMSNorm], GatedRMSNorm]:
    def make(norm: GatedRMSNorm) -> GatedRMSNorm:
        new = cls(norm.weight.shape[0], norm.eps)
        new.weight = norm.weight
        return new

    return make


def _cpu_linear(cls: type[CpuLinear]) -> Callable[[CpuLinear], CpuLinear]:
    return lambda lin: cls(lin.weight, lin.bias)


# plain module class -> (its native module, the native module -> a plain one); each pair shares the
# parameters and buffers of the module it replaces
_NATIVE: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: NativeRMSNorm, GatedRMSNorm: NativeGatedRMSNorm, SiluMul: NativeSiluMul,
    SigmoidGate: NativeSigmoidGate, DecayGates: NativeDecayGates, DeltaRecurrence: NativeDeltaRecurrence,
    CpuLinear: NativeCpuLinear, Int8Linear: NativeInt8Linear, Int4Linear: NativeInt4Linear,
}
_MAKE: dict[type[nn.Module], Callable[[type[nn.Module]], Callable[[nn.Module], nn.Module]]] = {
    RMSNorm: _norm, GatedRMSNorm: _gated_norm, SiluMul: lambda cls: lambda _m: cls(),
    SigmoidGate: lambda cls: lambda _m: cls(), DecayGates: lambda cls: lambda _m: cls(),
    DeltaRecurrence: lambda cls: lambda m: cls(m.cfg), CpuLinear: _cpu_linear,
    Int8Linear: lambda cls: cls.of, Int4Linear: lambda cls: cls.of,
}


def use_native_modules(model: CausalLM) -> None:
    """Replace, in place, each plain module of a fast-path model by its native module (module doc).
    The eager modules stay as they are."""
    if model.fused:
        makers = {plain: _MAKE[plain](fast) for plain, fast in _NATIVE.items()}
        dtype = model.model.norm.weight.dtype  # the activations'
        # 4-bit pairs take bfloat16 only; their scales halves where every 4-bit layer's are (one storage
        # kind for the whole model, as the fused decode step takes it)
        int4 = [m for m in model.modules() if type(m) is Int4Linear]
        half = all(native.halves_exact(m.weight_scale) for m in int4)
        makers[Int4Linear] = lambda lin: NativeInt4Linear.of(lin, dtype, half)
        if native.use_bf16_decode():  # oneDNN's bfloat16 products: the C kernel's for decode-sized steps too
            makers[PackedLinear] = NativePackedLinear.of
        # the fused projections' parts stay plain: never called, and a native copy of their weight
        # (float32 tiles) would be memory for nothing
        _replace(model, makers, keep={id(part) for part in fused_parts(model)})


def use_torch_modules(model: CausalLM) -> None:
    """Put the plain torch modules back, in place, wherever native ones were swapped in."""
    _replace(model, {fast: _MAKE[plain](plain) for plain, fast in _NATIVE.items()}
             | {NativePackedLinear: NativePackedLinear.plain})


def has_native_modules(model: nn.Module) -> bool:
    """Whether any of the model's modules runs cothink's C kernels."""
    return any(type(m) in (*_NATIVE.values(), NativePackedLinear) for m in model.modules())


def _replace(model: nn.Module, makers: dict[type[nn.Module], Callable[[nn.Module], nn.Module]],
             keep: Set[int] = frozenset()) -> None:
    """Each module of a type in `makers` replaced by make(module), but those whose id is in `keep`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            make = makers.get(type(child))
            if make is not None and id(child) not in keep:
                setattr(parent, name, make(child))
