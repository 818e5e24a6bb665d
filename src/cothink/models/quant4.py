"""Weight-only 4-bit quantization (opt-in: `load_model(..., quantize="int4")`) and GGUF's 4-bit tensors.

A weight [N, K] (K a multiple of Q4_GROUP = 32) is stored as groups of 32 consecutive weights of a
row: per group 32 codes q in 0..15 packed two to a byte (byte b holds weight b in its low nibble and
weight b + 16 in its high one: the layout of GGUF's Q4_0 and Q4_1 blocks) and a float32 scale and
offset. The weight's value is

    w = q * scale + offset        (float32, two roundings: `Int4Weights.dequantize`)

and a linear's product is, by definition, the float32 product with that dequantized weight:

    y = dtype(x.float() @ dequantize().T + bias.float())      (`reference_linear`, the exact semantics)

rounded to the activations' dtype once. GGUF's Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m) and Q4_K (per
32-weight sub-block w = (d sc) q - (dmin m)) are all of this form with float32 scale and offset, and
`Int4Weights.from_gguf` maps them exactly: its dequantized values equal the `gguf` package's
`dequantize` (to the bit, but for the sign of a zero: Q4_0's d (q - 8) is -0.0 where d < 0 and
q = 8). Quantizing a float weight (`Int4Weights.quantize`, at load) takes per group offset = min
and scale = (max - offset) / 15, each rounded to a half as Q4_1 stores them, and q = round((w - offset)
/ scale) clamped to 0..15: Q4_1's values (a weight that is a Q4_1 dequantization in float32 is
recovered to the bit almost everywhere, tested). Q4_0's and Q4_1's scales and offsets, and the
quantizer's, are halves exactly; Q4_K's products d sc are not.
GGUF files are read by `load_gguf_int4`, which takes a llama-architecture file's 4-bit tensors as
they are.

Storage is 6 bits per weight (4 for the code, 2 for the float32 scale and offset; the C kernel's copy in
pairs, below, 5 where every scale and offset of the model is a half); activations, norms,
attention, the KV pool and the (tied) embedding keep the model's dtype. The lm_head gets its own int8
copy (models/quantize.py `Int8Linear`), as GGUF's 4-bit files keep the output at 6 bits or more: on
SmolLM2's fixed text (`bench/int4_quality.py`) its layers quantized at load with an int8 lm_head raise
perplexity by 0.4% over bfloat16, with a 4-bit lm_head by 7%.

Products: under the native backend, steps of up to 32 rows run in cothink's C kernel (`native.linear`
with 4-bit weights, execution/native_modules.py `NativeInt4Linear`), which reads the packed codes
(once per call: above 8 rows each thread runs every row over its weight rows) and computes per
group scale (x . q) + offset sum(x) (bfloat16 activations, where the CPU has AVX-512 BF16: x . q by
VDPBF16PS on the codes widened to bfloat16, exact products): the reference product regrouped, equal to
it within float32 rounding, with one fixed order of sums per output (a row's result does not depend on
the batch nor on the thread count). The bound the tests hold it to (tests/models/test_quant4.py), per
output before the rounding to the activations' dtype:

    |y - y_ref| <= 2^-18 sum_g sum_j |x_j| (|scale_g| q_j + |offset_g|)

(about a fortieth of it on random data), so a bfloat16 result is the reference's or one bfloat16 step
from it. For a bfloat16 model where `native.bf16_pairs` (AVX-512 BF16 and VNNI, without AMX tiles), the
native module reads a copy of the weight reordered in tiles of 32 outputs (`native.pack_q4_pairs`,
native.c WT_Q4P) and takes x as 8-bit codes, as GGUF's Q4 x Q8 dot products (llama.cpp) and OpenVINO's
dynamically quantized activations take it: per group of 32 inputs a scale d = max |x| / 127 and codes
xq = x / d rounded (`quantize_activations`, to the bit), then per group d (scale xq . q + offset sum(xq))
with xq . q in exact integer sums (VPDPBUSD: twice the multiply-adds a cycle of bfloat16's): the
product with the 8-bit x in both terms (x's exact sum in the offsets' term left the codes' rounding
times the all-positive 4-bit codes uncancelled: perplexity +2.8% rather than +0.6%); each output along
a vector lane, one fixed order per output. Its distance from the reference adds half a code step of x
per input to the bound above (models/quantize.py `activation_bound`; w_j the dequantized weight):

    |y - y_ref| <= sum_g (d_g / 2) sum_j |w_j| + 2^-18 sum_g sum_j |x_j| (|scale_g| q_j + |offset_g|)

On SmolLM2's fixed text (`bench/int4_quality.py`, docs/benchmarks.md) perplexity is 0.6% over
bfloat16's fed 32 tokens a step (0.8% with bfloat16 activations, VDPBF16PS on the codes) and level
fed whole; llama.cpp's Q4_1 file (Q4 x Q8 products) is 0.5-0.8% over its BF16 re-encoding. Its scales and
offsets as halves (WT_Q4PH, the same results) where every 4-bit layer's are halves exactly (GGUF Q4_0 and
Q4_1, the quantizer; not Q4_K): a sixth fewer bytes for the decode to read. That copy takes every
product, prefill chunks too (30 SmolLM2 layers at 512 rows 1.3x the GEMM below); the packed weight
stays for inputs it does not take (float32 rows), so those 4-bit weights are held twice (SmolLM2 +63
MiB). Inputs of more than 32 rows on the packed weight (no copy in pairs: float32 models, CPUs
without AVX-512 BF16), and every input without the C kernels, dequantize the weight
(`native.q4_dequant`, the reference's values to the bit) and run a GEMM. Float32 activations, or a
CPU without bfloat16 arithmetic: float32 slabs and float32 GEMMs (models/packing.py
`widened_matmul`), the reference's product up to the order of float32 sums. Bfloat16 activations on
a CPU with bfloat16 arithmetic: the whole weight dequantized to bfloat16 (a temporary) and oneDNN's
bfloat16 GEMM (models/packing.py `bfloat16_matmul`, on AMX tiles where the CPU has them, as the
bfloat16 model's prefill), which adds one bfloat16 rounding of each weight to the bound above:

    |y - y_ref| <= 2^-8 sum_j |x_j w_j|        (w_j the dequantized weight; float32 sums)

Prefill-sized products are then as fast as the bfloat16 model's instead of float32 GEMM-bound
(docs/benchmarks.md); the C kernel's decode keeps the unrounded weights.

Quality is reported, not assumed: `bench/int4_quality.py` gives perplexity and greedy agreement
against bfloat16 (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cothink.errors import InvalidParameterError, UnsupportedModelError
from cothink.models.packing import (
    CpuLinear,
    FastLinear,
    bfloat16_matmul,
    can_pack,
    replace_linears,
    widened_matmul,
)
from cothink.models.quantize import Int8Linear
from cothink.ops import native

Q4_GROUP = native.Q4_GROUP  # weights per group (one scale and offset)
# GGUF's 4-bit types (gguf.GGMLQuantizationType values) and bytes per block of each
GGUF_Q4_0, GGUF_Q4_1, GGUF_Q4_K = 2, 3, 12
_BLOCK_BYTES = {GGUF_Q4_0: 18, GGUF_Q4_1: 20, GGUF_Q4_K: 144}
_BLOCK_WEIGHTS = {GGUF_Q4_0: 32, GGUF_Q4_1: 32, GGUF_Q4_K: 256}


@dataclass(frozen=True)
class Int4Weights:
    """A 4-bit weight [N, K] (module doc): `packed` uint8 [N, K / 2], group g of a row in bytes
    16 g .. 16 g + 15; `scale` float32 [N, K / 32, 2], per group (scale, offset)."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    def codes(self) -> torch.Tensor:
        """The codes q as uint8 [N, K], in weight order."""
        n, k = self.shape
        groups = self.packed.view(n, k // Q4_GROUP, Q4_GROUP // 2)
        return torch.cat([groups & 0x0F, groups >> 4], dim=-1).view(n, k)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight [N, K] (rows `rows` of it): q * scale + offset, two float32 roundings."""
        part = Int4Weights(self.packed[rows], self.scale[rows])
        n, k = part.shape
        q = part.codes().view(n, k // Q4_GROUP, Q4_GROUP).float()
        w = q * part.scale[..., :1]  # one rounding per op: torch does not fuse the multiply-add
        return (w + part.scale[..., 1:]).view(n, k)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int4Weights:
        """From codes uint8 [N, K] (0..15) and float32 scale, offset [N, K / 32]."""
        n, k = codes.shape
        if k % Q4_GROUP or scale.shape != (n, k // Q4_GROUP) or offset.shape != scale.shape:
            raise InvalidParameterError(
                f"4-bit weights need K a multiple of {Q4_GROUP} and one scale and offset per group; got "
                f"codes {tuple(codes.shape)}, scales {tuple(scale.shape)}, offsets {tuple(offset.shape)}")
        groups = codes.to(torch.uint8).view(n, k // Q4_GROUP, Q4_GROUP)
        packed = groups[..., : Q4_GROUP // 2] | (groups[..., Q4_GROUP // 2 :] << 4)
        return cls(packed.reshape(n, k // 2).contiguous(),
                   torch.stack([scale.float(), offset.float()], dim=-1).contiguous())

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weights:
        """Per group of 32: offset = min and scale = (max - offset) / 15, each rounded to a half (as Q4_1
        stores them; a value beyond the halves' range stays float32), q = round((w - offset) / scale)
        clamped to 0..15."""
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // Q4_GROUP, Q4_GROUP)
        low = _to_half(w.amin(dim=-1))
        scale = _to_half((w.amax(dim=-1) - low) / 15.0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every q is 0
        q = torch.round((w - low[..., None]) / safe[..., None]).clamp(0, 15)
        return cls.from_codes(q.to(torch.uint8).view(n, k), scale, low)

    @classmethod
    def from_gguf(cls, data: np.ndarray, qtype: int, shape: tuple[int, int]) -> Int4Weights:
        """A GGUF tensor of type Q4_0, Q4_1 or Q4_K (`qtype`, its raw blocks `data` as uint8 bytes,
        `shape` (N, K) in torch's order: GGUF lists it reversed), dequantizing exactly as gguf does."""
        n, k = shape
        if qtype not in _BLOCK_BYTES:
            raise UnsupportedModelError(f"GGUF tensor type {qtype} is not a 4-bit type this path reads "
                                        f"(Q4_0, Q4_1, Q4_K)")
        if k % _BLOCK_WEIGHTS[qtype]:
            raise InvalidParameterError(f"a GGUF row of {k} weights is not whole blocks of {qtype}")
        blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n * k // _BLOCK_WEIGHTS[qtype], -1)
        if blocks.shape[1] != _BLOCK_BYTES[qtype]:
            raise InvalidParameterError(
                f"GGUF blocks of {blocks.shape[1]} bytes, expected {_BLOCK_BYTES[qtype]}")
        half = lambda a, b: blocks[:, a:b].copy().view(np.float16).astype(np.float32)  # noqa: E731
        if qtype == GGUF_Q4_K:
            d, dmin = half(0, 2), half(2, 4)
            sc, mins = _q4k_scale_min(blocks[:, 4:16])
            scale = d * sc.astype(np.float32)  # [blocks, 8]: gguf's rounding of d * sc
            offset = -(dmin * mins.astype(np.float32))
            # a 64-weight chunk is 32 bytes: low nibbles its first sub-block, high nibbles its second
            qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            codes = (qs & 0x0F).reshape(n, k)
        else:
            d = half(0, 2)
            scale, offset = (d, -8.0 * d) if qtype == GGUF_Q4_0 else (d, half(2, 4))
            qs = blocks[:, -16:]
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        groups = k // Q4_GROUP
        return cls.from_codes(torch.from_numpy(codes.copy()), torch.from_numpy(scale.reshape(n, groups)),
                              torch.from_numpy(offset.reshape(n, groups)))

    def index_rows(self, index: torch.Tensor) -> Int4Weights:
        """Rows `index` of this weight, in that order."""
        return Int4Weights(self.packed[index].contiguous(), self.scale[index].contiguous())

    @staticmethod
    def cat(parts: list[Int4Weights]) -> Int4Weights:
        """The parts' rows stacked (a fused projection of several)."""
        return Int4Weights(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]))


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and mins per block from its 12 packed bytes [blocks, 12]: bytes 0-3
    hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from
    bytes 8-11 (low and high nibble) and their high 2 bits from the top bits of bytes 0-3 and 4-7."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def reference_linear(x: torch.Tensor, weights: Int4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """The semantics of a 4-bit linear (module doc): x [..., K] times the dequantized weight in
    float32, plus the bias, rounded to x's dtype once."""
    y = F.linear(x.float(), weights.dequantize(), None if bias is None else bias.float())
    return y.to(x.dtype)


class Int4Linear(FastLinear):
    """y = x W^T (+ b) with W stored as 4-bit groups (`Int4Weights`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self._hold(Int4Weights.quantize(weight), None if bias is None else bias.detach().clone())

    @classmethod
    def of_weights(cls, weights: Int4Weights, bias: torch.Tensor | None) -> Int4Linear:
        """A layer holding `weights` (no copy)."""
        layer = cls.__new__(cls)
        Int4Linear._hold(layer, weights, bias)
        return layer

    @classmethod
    def of(cls, other: Int4Linear) -> Int4Linear:
        """A layer of this class holding `other`'s weight and bias (no copy)."""
        return cls.of_weights(other.weights, other.bias)

    def _hold(self, weights: Int4Weights, bias: torch.Tensor | None) -> None:
        FastLinear.__init__(self)
        self.out_features, self.in_features = weights.shape
        self.register_buffer("weight_packed", weights.packed)
        self.register_buffer("weight_scale", weights.scale)
        self.register_buffer("bias", bias)

    @property
    def weights(self) -> Int4Weights:
        return Int4Weights(self.weight_packed, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if not x.is_cpu or rows.dtype not in (torch.float32, torch.bfloat16):
            return reference_linear(x, self.weights, self.bias)
        packed, scale = self.weight_packed, self.weight_scale
        use_native = native.available()

        def dequantize(slab: torch.Tensor, a: int, b: int) -> None:
            if use_native:
                native.q4_dequant(packed, scale, slice(a, b), slab)
            else:
                slab.copy_(self.weights.dequantize(slice(a, b)))

        if rows.dtype == torch.bfloat16 and can_pack(torch.bfloat16, "cpu"):  # bfloat16 GEMM (module doc)
            y = bfloat16_matmul(rows.contiguous(), dequantize, self.out_features, self.bias)
        else:
            y = widened_matmul(rows.contiguous(), dequantize, self.out_features, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit weights"


def _int4_or_dense(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """An Int4Linear, or (K not a multiple of 32) the dense CPU linear of the weight's dtype."""
    if weight.shape[1] % Q4_GROUP == 0:
        return Int4Linear(weight, bias)
    return CpuLinear(weight, bias)


def _to_half(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to the nearest half, where that is finite."""
    half = x.half().float()
    return torch.where(torch.isfinite(half), half, x)


def quantize_int4(model: nn.Module, gguf: Path | None = None) -> nn.Module:
    """Replace every nn.Linear of `model` (after any projection fusion) by an Int4Linear, in place,
    but the lm_head by an Int8Linear (module doc; a linear whose input width is not a multiple of 32
    keeps its weight, in models/packing.py's CpuLinear). With `gguf` (the file the checkpoint was
    converted from, `checkpoint_gguf`), the linears whose tensors there are 4-bit take them as they
    are (`load_gguf_int4`); the rest are quantized. Fused projections are quantized once, through the
    fused module (groups lie along a row, so the fused and the separate orders agree), and their
    HF-named parts dropped."""
    if gguf is not None:
        load_gguf_int4(model, gguf)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        model.lm_head = Int8Linear(head.weight, head.bias)
    return replace_linears(model, _int4_or_dense)


def checkpoint_gguf(folder: Path) -> Path | None:
    """The installed GGUF file an embedded model's converted `folder` was made from (models/hub.py
    records it), if it ships whole and is byte for byte the recorded one; None otherwise (a plain
    checkpoint, a model shipped in parts, another file). The embedded models shipped whole are
    llama-architecture, the files `load_gguf_int4` reads."""
    import json

    from cothink.errors import ModelNotFoundError
    from cothink.models.hub import _COMPLETE_MARKER, _sha256, find_embedded_gguf

    record_path = Path(folder) / _COMPLETE_MARKER
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    try:
        path = find_embedded_gguf(record.get("model", ""))
    except ModelNotFoundError:
        return None
    return path if _sha256(path) == record.get("gguf_sha256") else None


# GGUF tensor names of a llama-architecture model's linears, by the fused module's parts (HF names)
_GGUF_NAMES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's conversion of a Llama q or k projection (each head's rows
    interleaved into pairs for its rotary layout): hf[i] = gguf[index[i]]."""
    half = rows // heads // 2
    h, t, j = torch.meshgrid(torch.arange(heads), torch.arange(2), torch.arange(half), indexing="ij")
    return (h * 2 * half + 2 * j + t).reshape(-1)


def load_gguf_int4(model: nn.Module, path: str | Path) -> int:
    """Replace, in place, each linear of a fused llama-architecture `model` whose GGUF tensors (in the
    file at `path`, the checkpoint the model was converted from) are all 4-bit (Q4_0, Q4_1, Q4_K) by an
    Int4Linear holding them exactly; returns how many were replaced. Other linears are left as they
    are (`quantize_int4` then quantizes the rest)."""
    import gguf

    reader = gguf.GGUFReader(str(path))  # its index: a few seconds for a file with a large vocabulary
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise UnsupportedModelError(f"4-bit GGUF loading reads llama-architecture files; {path} is {arch!r}")
    heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    tensors = {t.name: t for t in reader.tensors}

    def part(layer: int, name: str) -> Int4Weights | None:
        t = tensors.get(f"blk.{layer}.{_GGUF_NAMES[name]}.weight")
        if t is None or int(t.tensor_type) not in _BLOCK_BYTES:
            return None
        k, n = (int(s) for s in t.shape)
        w = Int4Weights.from_gguf(np.asarray(t.data), int(t.tensor_type), (n, k))
        if name in ("q_proj", "k_proj"):  # llama.cpp permutes these rows at conversion
            w = w.index_rows(unpermute_rows(n, heads if name == "q_proj" else kv_heads))
        return w

    replaced = 0
    for index, layer in enumerate(model.model.layers):
        for module in (layer.mixer, layer.mlp):
            for fused, names in _FUSED.items():
                if getattr(module, fused, None) is not None:
                    replaced += _replace(module, fused, [part(index, n) for n in names])
            if getattr(module, "o_proj", None) is not None:
                replaced += _replace(module, "o_proj", [part(index, "o_proj")])
            if getattr(module, "down_proj", None) is not None:
                replaced += _replace(module, "down_proj", [part(index, "down_proj")])
    return replaced


def _replace(module: nn.Module, name: str, parts: list[Int4Weights | None]) -> int:
    """module.<name> <- an Int4Linear of the parts' rows (none missing, the shape unchanged)."""
    old = getattr(module, name)
    if any(p is None for p in parts):
        return 0
    weights = Int4Weights.cat([p for p in parts if p is not None])
    if weights.shape != (old.out_features, old.in_features):
        raise InvalidParameterError(f"GGUF weights {weights.shape} do not fit {name} "
                                    f"{(old.out_features, old.in_features)}")
    bias = getattr(old, "bias", None)
    setattr(module, name, Int4Linear.of_weights(weights, None if bias is None else bias.detach()))
    return 1
