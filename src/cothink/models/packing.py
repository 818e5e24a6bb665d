"""bfloat16 linears with oneDNN-prepacked weights (the fast path's CPU GEMV/GEMM for bfloat16).

`F.linear` on a plain bfloat16 weight reorders it for oneDNN on every call; a weight reordered once
at load (`mkldnn._reorder_linear_weight`, as inductor's freezing pass does) halves a decode step's
matmul time on an AVX-512-BF16 CPU (measured: a [49152, 576] lm_head GEMV 6.4 -> 3.4 ms) and gives
bit-identical results, row by row independent of the batch (tests/models/test_fast_path.py).
float32 keeps plain `F.linear`: MKL's packed fp32 path is not faster for the small layers here and
changes rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cothink.models.quantize import replace_linears


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Prepacking applies to bfloat16 on a CPU whose oneDNN has bfloat16 kernels."""
    return (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # a plain attribute, not a buffer: opaque tensors have no storage for state_dict or .to()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":  # not the fast path's input: plain math
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.packed.to_dense().to(x.dtype), bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked bf16"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a bfloat16 CPU model (after fusion) by a PackedLinear, in place;
    the HF-named parts of fused projections are dropped so their dense weights are freed."""
    return replace_linears(model, PackedLinear)
