"""The fast path's CPU linears (models/packing.py, and the native backend's, execution/native_modules.py)
against F.linear and a float64 reference: each kernel choice by dtype and row count, several weight
slabs, bias, inputs that are not the fast path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cothink.execution.native_modules import (
    NATIVE_MAX_ROWS,
    PAIRS_MAX_ROWS,
    NativeCpuLinear,
    NativeInt8Linear,
    NativePackedLinear,
)
from cothink.models import packing
from cothink.models.packing import WIDEN_MIN_ROWS, CpuLinear, PackedLinear
from cothink.ops import native


def _data(rows: int, out: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows", [1, 2, 5, NATIVE_MAX_ROWS + 1, 64, 65, 130])
def test_float32_matches_f_linear_at_every_row_count(rows):
    x, w, b = _data(rows, 300, 96, torch.float32)
    for bias in (None, b):
        got = CpuLinear(w, bias)(x)
        assert got.shape == (rows, 300) and got.is_contiguous()
        ref = _reference(x, w, bias)
        assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_run_in_the_c_kernel_independent_of_the_batch(dtype, monkeypatch):
    """Up to NATIVE_MAX_ROWS rows the C kernel runs the product (float32 sums in a fixed order per
    output): each row's result is the same to the bit alone or in any batch, and a bfloat16 result
    is the float32 product rounded once (within a bfloat16 rounding of float64)."""
    x, w, b = _data(NATIVE_MAX_ROWS, 200, 64, dtype, seed=1)
    called, kernel = [], native.linear
    monkeypatch.setattr(native, "linear", lambda *a, **kw: called.append(1) or kernel(*a, **kw))
    # a loaded model's weight requires grad: not a reason to skip
    lin = NativeCpuLinear(torch.nn.Parameter(w), b)
    whole = lin(x)
    assert len(called) == 1
    for a, c in ((0, 1), (3, 8), (5, NATIVE_MAX_ROWS)):
        assert torch.equal(lin(x[a:c]), whole[a:c])
    ref = _reference(x, w, b)
    if dtype == torch.bfloat16:
        assert ((whole.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    else:
        assert (whole.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    # above the limit: torch's kernels (float32 weights in tiles too: the plain path's bits)
    assert lin.native_rows == NATIVE_MAX_ROWS
    lin(torch.randn(NATIVE_MAX_ROWS + 1, 64).to(dtype))
    assert len(called) == 4


@pytest.mark.skipif(not native.bf16_pairs(), reason="bfloat16 pairs: CPUs with AVX-512 BF16 and no AMX tiles")
def test_bfloat16_in_pairs_takes_every_row_count_with_a_decode_steps_sums(monkeypatch):
    """A oneDNN-packed bfloat16 linear whose C copy is in pairs runs every product of bfloat16 rows in
    C, prefill-sized ones too (a GEMM from 24 rows on): each row's result the same to the bit as that
    row alone (as a decode step computes it), within a bfloat16 rounding of the float64 product. It
    holds the pairs only (no oneDNN copy): other inputs (float32 rows, a strided last dimension) run
    F.linear on the weight unpacked, and its plain module (`plain`, as `use_torch_modules` puts back)
    is the packed linear of the same weight."""
    x, w, b = _data(130, 96, 64, torch.bfloat16, seed=9)
    called, kernel = [], native.linear
    monkeypatch.setattr(native, "linear", lambda *a, **kw: called.append(1) or kernel(*a, **kw))
    packed = PackedLinear(w, b)
    lin = NativePackedLinear.of(packed)
    assert lin.native_rows == PAIRS_MAX_ROWS and lin.packed is None and torch.equal(lin.dense_weight(), w)
    whole = lin(x)
    assert len(called) == 1 and whole.dtype == torch.bfloat16 and whole.shape == (130, 96)
    for row in (0, 23, 24, 77, 129):
        assert torch.equal(lin(x[row:row + 1]), whole[row:row + 1])
    ref = _reference(x, w, b)
    sums = F.linear(x.double().abs(), w.double().abs())
    assert ((whole.double() - ref).abs() <= ref.abs() * 2**-8 + sums * 64 * 2**-24 + 1e-6).all()
    called.clear()
    assert torch.equal(lin(x.float()), F.linear(x.float(), w.float(), b.float())) and not called
    strided = x.t().contiguous().t()
    assert torch.equal(lin(strided), F.linear(strided, w, b)) and not called
    plain = lin.plain()
    assert type(plain) is PackedLinear and torch.equal(plain(x), packed(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_forward_is_forward_widened_to_float32_to_the_bit(dtype, monkeypatch):
    """The head's float32 logits: in one C call up to NATIVE_MAX_ROWS rows (where it runs), through
    `forward` above; the same values as forward(x).float() either way."""
    x, w, b = _data(NATIVE_MAX_ROWS + 1, 200, 64, dtype, seed=2)
    calls, kernel = [], native.linear
    monkeypatch.setattr(native, "linear", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    lin = NativeCpuLinear(w, b)
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1):
        got = lin.float_forward(x[:rows])
        assert got.dtype == torch.float32 and torch.equal(got, lin(x[:rows]).float())
    if native.available():
        # float_forward, then forward, per row count; the last row count is torch's kernels'
        assert [kw["float_out"] for kw in calls] == [True, False, True, False]


def test_bfloat16_below_the_widening_threshold_without_c_kernels_is_f_linear_to_the_bit(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", False)
    x, w, b = _data(WIDEN_MIN_ROWS - 1, 200, 64, torch.bfloat16)
    assert torch.equal(CpuLinear(w, b)(x), F.linear(x, w, b))


@pytest.mark.parametrize("rows", [NATIVE_MAX_ROWS + 1, 64, 100])
def test_bfloat16_widened_rounds_the_float32_product_once(rows, monkeypatch):
    """Many slabs (a scratch of 4 rows, so 200 rows take 50 slabs) and a bias: the result is the
    float32 product rounded to bfloat16, i.e. within one bfloat16 rounding of the float64 product."""
    monkeypatch.setattr(packing, "_scratch", lambda: torch.empty(4 * 64))
    x, w, b = _data(rows, 200, 64, torch.bfloat16, seed=rows)
    for bias in (None, b):
        got = CpuLinear(w, bias)(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
        ref = _reference(x, w, bias)
        # a bfloat16 has 8 significant bits: a correctly rounded result is within 2^-8 relative
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
        plain = F.linear(x, w, bias)
        assert (got.float() - plain.float()).abs().max() <= 2**-7 * plain.float().abs().max()


def test_widened_rows_do_not_depend_on_the_batch():
    x, w, _ = _data(40, 120, 64, torch.bfloat16, seed=3)
    lin = CpuLinear(w, None)
    whole = lin(x)
    for a, b in ((0, WIDEN_MIN_ROWS), (5, 22), (39, 40)):  # the last: one row, not widened
        got, ref = lin(x[a:b]).float(), whole[a:b].float()
        assert (got - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_three_dimensional_input_and_foreign_dtype():
    x, w, b = _data(6, 50, 32, torch.float32)
    lin = CpuLinear(w.bfloat16(), b.bfloat16())
    x3 = x.bfloat16().view(2, 3, 32).repeat(1, 4, 1)  # [2, 12, 32]: 24 rows
    got = lin(x3)
    assert got.shape == (2, 12, 50)
    assert (got.float() - F.linear(x3, w.bfloat16(), b.bfloat16()).float()).abs().max() < 0.05
    # a float32 input to a bfloat16 layer is not the fast path's: plain math in the input's dtype
    got32 = lin(x)
    assert got32.dtype == torch.float32
    assert torch.allclose(got32, F.linear(x, w.bfloat16().float(), b.bfloat16().float()))


def test_parameters_stay_visible_and_share_the_weight():
    _, w, b = _data(1, 20, 8, torch.float32)
    lin = CpuLinear(w, b)
    assert lin.weight.data_ptr() == w.data_ptr()
    assert sum(p.numel() for p in lin.parameters()) == w.numel() + b.numel()
    assert set(lin.state_dict()) == {"weight", "bias"}


def test_int8_wide_inputs_dequantize_to_float32_slabs(monkeypatch):
    """Above the int8 kernel's row limit the weight is dequantized (to float32 slabs where the CPU has
    no bfloat16 arithmetic, else to bfloat16): the product of the dequantized weight either way."""
    from cothink.models.quantize import INT8_KERNEL_MAX_ROWS, Int8Linear

    monkeypatch.setattr(packing, "_scratch", lambda: torch.empty(7 * 64))  # 7-row slabs: 18 of them
    x, w, b = _data(max(INT8_KERNEL_MAX_ROWS, NATIVE_MAX_ROWS) + 9, 120, 64, torch.bfloat16, seed=4)
    lin = Int8Linear(w, b)
    got = lin(x)
    ref = _reference(x, lin.dequantized(torch.float32), b)
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], 120)
    # dequantized in float32 (no bfloat16 arithmetic) or rounded to bfloat16 first (oneDNN): within
    # a few bfloat16 roundings of the float64 product
    assert (got.double() - ref).abs().max() <= 2**-6 * ref.abs().max()


@pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_few_rows_run_in_the_c_kernel_as_torchs_int8_kernel_computes(dtype, monkeypatch):
    """Up to NATIVE_MAX_ROWS rows an int8 layer runs in the C kernel (input rounded to bfloat16, sum
    times the row scale rounded to bfloat16, then the bias, as `_weight_int8pack_mm` + the bias add):
    within one bfloat16 rounding of torch's int8 kernel (other sum order), each row the same to the
    bit alone or in a batch, the float32 logits form equal to the result widened."""
    from cothink.models.quantize import _INT8_MM

    x, w, b = _data(NATIVE_MAX_ROWS, 200, 96, dtype, seed=6)
    called, kernel = [], native.linear
    monkeypatch.setattr(native, "linear", lambda *a, **kw: called.append(1) or kernel(*a, **kw))
    for bias in (None, b):
        lin = NativeInt8Linear(w, bias)
        assert lin.native_rows == NATIVE_MAX_ROWS
        got = lin(x)
        assert got.dtype == dtype and len(called) == 1
        for a, c in ((0, 1), (3, 8), (5, NATIVE_MAX_ROWS)):
            assert torch.equal(lin(x[a:c]), got[a:c])
        assert torch.equal(lin.float_forward(x), got.float())
        if _INT8_MM is not None:
            want = _INT8_MM(x.to(torch.bfloat16), lin.weight_int8, lin.scale).to(dtype)
            want = want if bias is None else want + bias
            assert ((got.double() - want.double()).abs() <= want.double().abs() * 2**-7 + 1e-5).all()
        called.clear()
