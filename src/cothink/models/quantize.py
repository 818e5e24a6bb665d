"""Weight-only int8 quantization (opt-in: `load_model(..., quantize="int8")`).

Every linear layer's weight becomes int8 with one bfloat16 scale per output row (symmetric,
absmax / 127); activations, norms, attention and the KV pool keep the model's dtype. Decode reads
half the weight bytes of bfloat16: through torch's CPU int8 weight-only kernel
(`aten._weight_int8pack_mm`, the op gpt-fast uses), and under the native execution backend for steps
of a few rows through cothink's C kernel (`native.linear` with row scales,
execution/native_modules.py `NativeInt8Linear`; the fused decode step takes int8 models too); both
take bfloat16 activations and round the result as that op does. For wide
inputs (prefill chunks) that kernel is slower than a dense matmul, so there the layer dequantizes
its weight once per call and runs the ordinary bfloat16 GEMM (on a CPU without bfloat16 arithmetic:
dequantized to float32 a slab at a time, as models/packing.py widens bfloat16): the cost is one
weight read for many rows. The lm_head gets its own int8 copy; the (tied) embedding stays in the
model dtype for lookup.

Where the C kernel reads the weight in pairs (`native.takes_pairs`: AVX-512 BF16 and VNNI, K a
multiple of 32) it takes every product, prefill chunks too, and takes x as 8-bit codes per group of
32 (`quantize_activations`: scale d = max |x| / 127, codes x / d rounded), as llama.cpp's Q8_0 products
and the 4-bit pairs (models/quant4.py) do: the int8 dot products of the codes (VPDPBUSD, exact), per
group times d, then the same scale, rounding and bias as above. Its distance from the product of x
rounded to bfloat16, before that rounding (`activation_bound`, tests/ops/test_native.py):

    |y - y_bf16| <= scale sum_g (d_g / 2) sum_j |q_j|  (plus float32 sums)

On SmolLM2's fixed text (`bench/int8_quality.py`) perplexity is 1.3% over bfloat16's where the bfloat16
x gave 0.2% (docs/benchmarks.md); 32 coroutines ~1.3x faster.

The MoE and Kimi Linear families (qwen3_5_moe, qwen3_next, kimi_linear) are quantized the same way,
but for the projections whose few outputs drive decays and gates: their routers (parameters, not
linears), the Qwen shared-expert gate, Gated DeltaNet's b and a inputs (beta and the decay; where the
inputs are fused, the fused weight's last rows stay dense in a `RowSplitLinear`) and KDA's decay
(f_a_proj, f_b_proj) and beta (b_proj) inputs keep the model dtype, in the fast path's dense CPU
linear (`dense_linear`). Int8 are their attention, MLA (q, kv_a, o; kv_b_proj is absorbed, not a
linear), Gated DeltaNet q/k/v, z and out, KDA q/k/v, output gate (g_a, g_b) and o, dense MLP,
shared-expert and routed-expert linears (one Int8Linear per expert and projection, models/moe.py
`ExpertLinears`: the per-row scales are per expert). These families run no native modules, so their
int8 products take torch's kernel or the dequantized GEMM above. The dense Qwen3.5 hybrid and int4
for these families stay refused (`check_quantize`).

Quality is reported, not assumed: docs/benchmarks.md gives greedy agreement and perplexity change
(the dense families; the MoE families are checked on tiny random models in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cothink.errors import InvalidParameterError, UnsupportedModelError
from cothink.models.kda import KimiDeltaAttention
from cothink.models.moe import SparseMoeBlock, split_experts
from cothink.models.packing import (
    CpuLinear,
    FastLinear,
    PackedLinear,
    can_pack,
    drop_fused_parts,
    replace_linears,
    widened_matmul,
)
from cothink.models.transformer import GatedDeltaNet
from cothink.ops import native

QUANTIZE_MODES = ("int8", "int4")  # "int4": models/quant4.py
# Families whose every linear is a plain projection of the residual stream, validated for quality.
# The Qwen3.5 hybrid's Gated DeltaNet gates (a few output rows driving exp/softplus decays) are not.
INT4_FAMILIES = ("llama", "qwen2", "qwen3")
# int8 also takes the MoE and Kimi Linear families: their gates stay in the model dtype (module doc)
INT8_FAMILIES = (*INT4_FAMILIES, "qwen3_5_moe", "qwen3_next", "kimi_linear")
# linears kept in the model dtype under int8, by module: GDN's beta and decay inputs, KDA's decay
# (low-rank f_a, f_b) and beta inputs, the Qwen MoE's shared-expert gate
_KEPT_DENSE: tuple[tuple[type[nn.Module], tuple[str, ...]], ...] = (
    (GatedDeltaNet, ("in_proj_b", "in_proj_a")),
    (KimiDeltaAttention, ("f_a_proj", "f_b_proj", "b_proj")),
    (SparseMoeBlock, ("shared_expert_gate",)),
)
# rows per call up to which the int8 kernel beats dequantize + dense GEMM (measured: bench/limits)
INT8_KERNEL_MAX_ROWS = 16

_INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M, K] (K a multiple of 32, native.Q4_GROUP) as the C kernel's int8 and 4-bit products in
    pairs take them (native.c `quantize_groups`, to the bit): per group of 32 inputs a float32 scale
    d = max |x| / 127 and int8 codes x (1 / d) rounded to nearest (even), all 0 where d is 0. Returns
    (codes [M, K] int8, scales [M, K / 32] float32)."""
    m, k = x.shape
    groups = x.float().view(m, k // native.Q4_GROUP, native.Q4_GROUP)
    d = groups.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(groups * inverse[..., None]).to(torch.int8)
    return codes.view(m, k), d


def activation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far the C kernel's int8 or 4-bit product in pairs (x rounded to bfloat16, then taken as 8-bit
    codes, `quantize_activations`) is from the product of x rounded to bfloat16 with the dense `weight`
    [N, K] it stands for (int8: the codes times their scales; 4-bit: the dequantized weight), before
    float32 rounding (module doc, models/quant4.py): per group half a code step of x (d / 2) times
    sum_j |w_j|. [M, N] float64"""
    n, k = weight.shape
    _, d = quantize_activations(x.to(torch.bfloat16))
    magnitude = weight.abs().double().view(n, k // native.Q4_GROUP, native.Q4_GROUP).sum(-1)  # [N, groups]
    return (d.double() / 2) @ magnitude.T


class Int8Linear(FastLinear):
    """y = x W^T (+ b) with W stored as int8 [out, in] and a bfloat16 scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self._hold(q.contiguous(), scale.to(torch.bfloat16), None if bias is None else bias.detach().clone())

    @classmethod
    def of(cls, other: Int8Linear) -> Int8Linear:
        """A layer of this class holding `other`'s int8 weight, scales and bias (no copy)."""
        layer = cls.__new__(cls)
        Int8Linear._hold(layer, other.weight_int8, other.scale, other.bias)
        return layer

    def _hold(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        FastLinear.__init__(self)
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_int8.to(dtype) * self.scale.to(dtype)[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        cpu = x.device.type == "cpu"
        # torch's int8 kernel reads past the row when in_features is not a multiple of 16 (garbage out)
        small = rows.shape[0] <= INT8_KERNEL_MAX_ROWS and self.in_features % 16 == 0
        if small and _INT8_MM is not None and cpu:
            y = _INT8_MM(rows.to(torch.bfloat16).contiguous(), self.weight_int8, self.scale).to(x.dtype)
        elif cpu and not can_pack(torch.bfloat16, "cpu"):  # no bfloat16 arithmetic: float32 slabs
            scale = self.scale.float()[:, None]

            def dequantize(slab: torch.Tensor, a: int, b: int) -> None:
                torch.mul(self.weight_int8[a:b], scale[a:b], out=slab)

            y = widened_matmul(rows.to(torch.bfloat16), dequantize, self.out_features, None).to(x.dtype)
        else:
            y = F.linear(rows.to(torch.bfloat16), self.dequantized(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def check_quantize(mode: str | None, family: str) -> None:
    """Raise a typed error unless `mode` (None: no quantization) applies to `family`."""
    if mode is None:
        return
    if mode not in QUANTIZE_MODES:
        raise InvalidParameterError(f"quantize must be one of {QUANTIZE_MODES} or None, got {mode!r}",
                                    param="quantize")
    families = INT8_FAMILIES if mode == "int8" else INT4_FAMILIES
    if family not in families:
        raise UnsupportedModelError(
            f"quantize={mode!r} supports the model families {families}; this model is {family!r}",
            param="quantize",
        )


class RowSplitLinear(FastLinear):
    """y = [head(x) | tail(x)]: a fused projection whose first rows are int8 and whose last rows (gate
    inputs) keep the model dtype (Gated DeltaNet's fused in_proj: q/k/v and z int8, b and a dense)."""

    def __init__(self, head: nn.Module, tail: nn.Module):
        super().__init__()
        self.head, self.tail = head, tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.head(x), self.tail(x)), dim=-1)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> FastLinear:
    """A linear kept in the model dtype under quantization: the fast path's CPU kernel for its dtype
    (models/packing.py), which runs any other input as plain `F.linear`."""
    if can_pack(weight.dtype, weight.device):
        return PackedLinear(weight, bias)
    return CpuLinear(weight, bias)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the nn.Linears of `model` (after any projection fusion) by Int8Linears, in place.

    Projections that were fused are quantized once, through the fused module, and their HF-named
    parts (views of the fused weight, unused by the fused forward) are dropped, so no dense copy of
    a quantized weight stays alive. Per-row scales make the two orders identical. MoE experts are
    quantized one linear per expert (models/moe.py `ExpertLinears`). The gate inputs in `_KEPT_DENSE`
    keep the model dtype (`dense_linear`); where Gated DeltaNet's inputs are fused, its b and a rows
    (the fused weight's last rows) stay dense in a `RowSplitLinear`. Routers are parameters, not
    linears, and keep the model dtype.
    """
    split_experts(model)
    kept: set[int] = set()
    for module in list(model.modules()):
        for kind, names in _KEPT_DENSE:
            if isinstance(module, kind):
                linears = (getattr(module, name, None) for name in names)
                kept.update(id(lin.weight) for lin in linears if isinstance(lin, nn.Linear))
        if isinstance(module, GatedDeltaNet) and isinstance(module.in_proj, nn.Linear):
            w = module.in_proj.weight.detach()
            rows = module.in_sizes[0] + module.in_sizes[1]  # q/k/v and z; then b and a
            module.in_proj = RowSplitLinear(Int8Linear(w[:rows], None), dense_linear(w[rows:].clone(), None))
    drop_fused_parts(model)

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return dense_linear(weight, bias) if id(weight) in kept else Int8Linear(weight, bias)

    return replace_linears(model, make)
