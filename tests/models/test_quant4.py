"""Weight-only 4-bit weights (models/quant4.py): GGUF's Q4_0 / Q4_1 / Q4_K tensors dequantize exactly as
the gguf package does, the C kernel stays within the documented float32 bound of the reference product
and its layout in pairs (8-bit activations) within the documented bound that adds the activations'
rounding, its quantizer to the bit (both independent of the thread count and of the batch), and a tiny
model stays close to bfloat16."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from reference import random_ids

import cothink
from cothink.errors import UnsupportedModelError
from cothink.execution.fused_decode import FusedDecode
from cothink.execution.native_modules import NATIVE_MAX_ROWS, NativeCpuLinear, NativeInt4Linear
from cothink.models.packing import CpuLinear
from cothink.models.quant4 import (
    Int4Linear,
    Int4Weights,
    checkpoint_gguf,
    load_gguf_int4,
    reference_linear,
)
from cothink.models.quantize import Int8Linear, activation_bound, quantize_activations
from cothink.ops import native

needs_native = pytest.mark.skipif(not native.available(), reason="cothink's C kernels are not built here")
Q = gguf.GGMLQuantizationType


def _q4k_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks [rows, k / 256 * 144] bytes: finite float16 d and dmin, every other byte any."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // 256, 144), dtype=np.uint8)
    halves = rng.uniform(-0.05, 0.05, size=(rows * k // 256, 2)).astype(np.float16)
    blocks[:, :4] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


def _write_and_read(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_gguf_4bit_tensors_dequantize_as_gguf_does(tmp_path):
    rng = np.random.default_rng(3)
    dense = rng.standard_normal((48, 512)).astype(np.float32) * 0.1
    dense[5, :32] = 0.25  # a constant block (zero scale)
    written = {
        "q4_0": (gguf.quants.quantize(dense, Q.Q4_0), Q.Q4_0),
        "q4_1": (gguf.quants.quantize(dense, Q.Q4_1), Q.Q4_1),
        "q4_k": (_q4k_blocks(48, 512, seed=4), Q.Q4_K),
    }
    reader = _write_and_read(tmp_path / "tiny.gguf", written)
    for t in reader.tensors:
        k, n = (int(s) for s in t.shape)
        assert (n, k) == (48, 512)
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k)
        got = Int4Weights.from_gguf(np.asarray(t.data), int(t.tensor_type), (n, k)).dequantize()
        assert got.dtype == torch.float32
        # equal values (Q4_0's d (q - 8) is -0.0 where d < 0 and q = 8; q d + (-8 d) is +0.0 there)
        assert np.array_equal(got.numpy(), want.astype(np.float32)), t.name
        nonzero = want != 0
        bits = want[nonzero].astype(np.float32).view(np.int32)
        assert np.array_equal(got.numpy()[nonzero].view(np.int32), bits)


def test_quantize_recovers_q4_1_values_and_bounds_the_error():
    rng = np.random.default_rng(5)
    dense = rng.standard_normal((64, 256)).astype(np.float32) * 0.05
    q41 = gguf.quants.dequantize(gguf.quants.quantize(dense, Q.Q4_1), Q.Q4_1).reshape(64, 256)
    again = Int4Weights.quantize(torch.from_numpy(q41)).dequantize()
    same = (again == torch.from_numpy(q41)).float().mean().item()
    assert same > 0.99  # a Q4_1 dequantization is (almost everywhere) its own float32 quantization
    w = torch.from_numpy(dense)
    err = (Int4Weights.quantize(w).dequantize() - w).abs()
    step = (w.view(64, 8, 32).amax(-1) - w.view(64, 8, 32).amin(-1)) / 15
    assert (err.view(64, 8, 32) <= step[..., None] / 2 * (1 + 1e-5) + 1e-7).all()  # half a step, rounding


def _bound(x: torch.Tensor, weights: Int4Weights) -> torch.Tensor:
    """The documented kernel bound: 2^-18 sum_g sum_j |x_j| (|scale_g| q_j + |offset_g|)."""
    n, k = weights.shape
    groups = k // 32
    q = weights.codes().float().view(n, groups, 32)
    scale, offset = weights.scale[..., 0].abs(), weights.scale[..., 1].abs()
    mag = (q * scale[..., None] + offset[..., None]).view(n, k)
    return 2.0**-18 * (x.float().abs() @ mag.T)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_within_bound_of_the_reference_for_any_threads_and_batch(dtype):
    torch.manual_seed(0)
    n, k = 200, 320
    weights = Int4Weights.quantize(torch.randn(n, k))
    bias = torch.randn(n).to(dtype)
    x = torch.randn(32, k).to(dtype)
    exact = torch.nn.functional.linear(x.float(), weights.dequantize(), bias.float())
    got = native.linear(x, weights.packed, bias, scale=weights.scale, float_out=True)
    rounding = exact.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0.0  # float_out: rounded to the dtype
    assert ((got - exact).abs() <= _bound(x, weights) + rounding).all()
    if dtype == torch.bfloat16:  # one rounding to bfloat16: the reference's, or the neighbour
        ref = reference_linear(x, weights, bias).float()
        assert ((got - ref).abs() <= ref.abs() * 2.0**-7).all()
    rows = [native.linear(x[i : i + 1], weights.packed, bias, scale=weights.scale) for i in range(32)]
    assert torch.equal(torch.cat(rows), native.linear(x, weights.packed, bias, scale=weights.scale))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(torch.cat([native.linear(x[:5], weights.packed, bias, scale=weights.scale),
                                   native.linear(x, weights.packed, bias, scale=weights.scale)]))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


needs_pairs = pytest.mark.skipif(not native.bf16_pairs(), reason="AVX-512 BF16, no AMX tiles")


@needs_pairs
@pytest.mark.parametrize("k", [320, 576])
def test_4bit_pairs_stay_within_the_bound_for_any_threads_and_batch(k):
    """A 4-bit weight in pairs (`pack_q4_pairs`: the same codes and scales, in tiles of PAIR_TILE outputs)
    under bfloat16 rows taken as 8-bit codes: the exact product of those codes (`quantize_activations`)
    within float32 rounding, so within the documented bound of the reference (`activation_bound` added),
    each row's result the same in any batch and on any thread count. K = 576: 18 groups, which the
    kernel quantizes 16 at a time and then the 2 left one by one."""
    torch.manual_seed(1)
    n = 96
    weights = Int4Weights.quantize(torch.randn(n, k))
    pairs, scales = native.pack_q4_pairs(weights.packed, weights.scale)
    assert pairs.dtype == torch.uint16 and pairs.shape == (n, k // 4) and scales.shape == (3, k // 32, 2, 32)
    # tile 1, group 3, four inputs 5, byte 4 * 3 + 2: outputs 32 + 3 (low nibble) and 32 + 16 + 3 (high),
    # input 96 + 20 + 2
    byte = int(pairs.view(torch.uint8).view(3, k // 32, 8, 64)[1, 3, 5, 14])
    codes = weights.codes()
    assert (byte & 15, byte >> 4) == (int(codes[35, 118]), int(codes[51, 118]))
    assert torch.equal(scales[1, 3, :, 5], weights.scale[37, 3])
    bias = torch.randn(n).bfloat16()
    assert native.linear_fits(pairs, bias, scales) and native.linear_fits(pairs, None, scales)
    assert not native.linear_fits(pairs, bias.float(), scales)  # C reads the bias in x's dtype: bfloat16
    assert not native.linear_fits(pairs, bias, weights.scale)
    x = torch.randn(33, k).bfloat16()
    x[3, 64:96] = 0  # a group of zeros: scale 0, codes 0
    x[4, k - 32:] = 0  # and one among the groups left after the kernel's blocks of 16
    exact = torch.nn.functional.linear(x.float(), weights.dequantize(), bias.float())
    got = native.linear(x, pairs, bias, scale=scales, float_out=True)
    rounding = _bound(x, weights) + exact.abs() * 2.0**-8  # float32 sums, the bfloat16 result
    assert ((got - exact).abs() <= activation_bound(x, weights.dequantize()) + rounding).all()
    assert ((got - exact).abs() > rounding).any()  # the 8-bit x is not the bfloat16 x
    codes, d = quantize_activations(x)
    assert codes.abs().max() == 127 and torch.equal(codes[3, 64:96], torch.zeros(32, dtype=torch.int8))
    groups = k // 32
    q = weights.codes().double().view(n, groups, 32)
    dot = torch.einsum("mgj,ngj->mng", codes.double().view(33, groups, 32), q)  # exact integer sums
    scale, offset = weights.scale[..., 0].double(), weights.scale[..., 1].double()
    xsum = d.double() * codes.double().view(33, groups, 32).sum(-1)  # the 8-bit x's group sums
    of_codes = (dot * d.double()[:, None, :] * scale[None]).sum(-1) + xsum @ offset.T + bias.double()
    assert ((got - of_codes).abs() <= rounding).all()  # one code off would move an output far past this
    for m in (1, 5, 8, 9, 32, 33):
        rows = [native.linear(x[i : i + 1], pairs, bias, scale=scales) for i in range(m)]
        assert torch.equal(torch.cat(rows), native.linear(x[:m], pairs, bias, scale=scales))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native.linear(x, pairs, bias, scale=scales))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x.float(), pairs, None, scale=scales)  # pairs take bfloat16 rows only
    with pytest.raises(ValueError, match="pack_q4_pairs"):
        native.pack_q4_pairs(weights.packed[:40], weights.scale[:40])  # not whole tiles


@needs_pairs
def test_4bit_pairs_with_half_scales_are_the_float32_scales_results():
    """Scales and offsets that are halves exactly (the quantizer's; GGUF Q4_0 and Q4_1 store them so)
    kept as halves in the pairs (native.c WT_Q4PH): the same results to the bit as float32 scales, at
    any row count and thread count; Q4_K's scales (d sc) are not halves and are refused as halves."""
    torch.manual_seed(4)
    n, k = 96, 320
    weights = Int4Weights.quantize(torch.randn(n, k) * 0.05)
    assert native.halves_exact(weights.scale)
    pairs, scales = native.pack_q4_pairs(weights.packed, weights.scale)
    same, halves = native.pack_q4_pairs(weights.packed, weights.scale, half=True)
    assert torch.equal(same, pairs) and halves.dtype == torch.float16 and torch.equal(halves.float(), scales)
    bias = torch.randn(n).bfloat16()
    assert native.linear_fits(pairs, bias, halves) and not native.linear_fits(pairs, bias, halves.bfloat16())
    x = torch.randn(33, k).bfloat16()
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for m in (1, 3, 8, 9, 33):
                for float_out in (False, True):
                    got = native.linear(x[:m], pairs, bias, scale=halves, float_out=float_out)
                    want = native.linear(x[:m], pairs, bias, scale=scales, float_out=float_out)
                    assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)
    q4k = Int4Weights.from_gguf(_q4k_blocks(n, 512, seed=5), Q.Q4_K, (n, 512))
    assert not native.halves_exact(q4k.scale)
    with pytest.raises(ValueError, match="not all halves"):
        native.pack_q4_pairs(q4k.packed, q4k.scale, half=True)


@needs_pairs
def test_native_4bit_linear_takes_pairs_for_bfloat16_activations():
    """The native module reads the weight in pairs where the model's activations are bfloat16 (given at
    the swap), the packed weight otherwise; rows of the other dtype take the torch path."""
    torch.manual_seed(3)
    plain = Int4Linear(torch.randn(64, 96), None)
    pairs, packed = NativeInt4Linear.of(plain, torch.bfloat16), NativeInt4Linear.of(plain, torch.float32)
    assert pairs.operands()[0].dtype == torch.uint16 and pairs.native_rows > 0
    assert packed.operands()[0] is plain.weight_packed and packed.takes_dtype(torch.float32)
    assert not pairs.takes_dtype(torch.float32) and pairs.weight_packed is plain.weight_packed
    x = torch.randn(5, 96)
    ref = reference_linear(x.bfloat16(), plain.weights, None).float()
    bound = activation_bound(x, plain.weights.dequantize()) + ref.abs() * 2.0**-7
    assert ((pairs(x.bfloat16()).float() - ref).abs() <= bound).all()
    # pairs take every product in C, a prefill chunk's too: each row as alone, a row's result the decode's
    assert pairs.native_rows > NATIVE_MAX_ROWS and packed.native_rows == NATIVE_MAX_ROWS
    wide = torch.randn(2, 35, 96).bfloat16()
    alone = torch.stack([torch.cat([pairs(wide[b, t : t + 1]) for t in range(35)]) for b in range(2)])
    assert torch.equal(pairs(wide), alone)
    torch.testing.assert_close(pairs(x), packed(x), rtol=1e-5, atol=1e-5)  # float32: the torch path


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequant_is_the_reference_to_the_bit(dtype):
    """native.q4_dequant writes the reference's float32 values, or those rounded to bfloat16 as torch
    rounds them."""
    torch.manual_seed(1)
    weights = Int4Weights.quantize(torch.randn(70, 96) * 3)
    out = torch.empty(40, 96, dtype=dtype)
    native.q4_dequant(weights.packed, weights.scale, slice(20, 60), out)
    assert torch.equal(out, weights.dequantize()[20:60].to(dtype))
    with pytest.raises(ValueError, match="q4_dequant"):
        native.q4_dequant(weights.packed, weights.scale, slice(0, 4), torch.empty(4, 95))


@pytest.mark.parametrize("kernels", [True, False])
def test_wide_inputs_take_the_dequantized_gemm(monkeypatch, kernels):
    if kernels and not native.available():
        pytest.skip("cothink's C kernels are not built here")
    monkeypatch.setattr(native, "ENABLED", kernels)
    torch.manual_seed(2)
    dense = torch.nn.Linear(128, 80)
    layer = Int4Linear(dense.weight, dense.bias)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 70, 128).to(dtype)
        got, ref = layer(x.to(dtype)), reference_linear(x, layer.weights, layer.bias)
        assert got.shape == (3, 70, 80) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2.0**-7
        assert ((got.float() - ref.float()).abs() <= tol * ref.float().abs().clamp(min=1)).all()


def test_bfloat16_wide_inputs_stay_within_the_rounded_weight_bound(monkeypatch):
    """Bfloat16 activations on a CPU with bfloat16 arithmetic take the bfloat16 GEMM over weights
    rounded to bfloat16: within models/quant4.py's bound of the float32 reference,
    2^-8 sum |x_j w_j| before the result's own rounding to bfloat16."""
    from cothink.models import packing, quant4

    calls = []
    monkeypatch.setattr(quant4, "bfloat16_matmul", lambda *a: calls.append(1) or packing.bfloat16_matmul(*a))
    monkeypatch.setattr(quant4, "can_pack", lambda dtype, device: True)  # as on such a CPU
    torch.manual_seed(3)
    dense = torch.nn.Linear(128, 80)
    layer = Int4Linear(dense.weight, dense.bias)
    x = torch.randn(70, 128).to(torch.bfloat16)
    got, ref = layer(x).double(), reference_linear(x.float(), layer.weights, layer.bias).double()
    assert calls and got.shape == (70, 80)
    bound = 2.0**-8 * (x.double().abs() @ layer.weights.dequantize().double().abs().t())
    assert ((got - ref).abs() <= bound + 2.0**-8 * ref.abs()).all()
    # the bound is not vacuous: the weights' rounding moves some output
    assert not torch.equal(got, reference_linear(x, layer.weights, layer.bias).double())


def _logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits of a 20-token prefill, then of four decode steps (the wide and the narrow products)."""
    block = runner.new_block()
    return torch.cat([runner.extend(block, ids[:20]), *(runner.extend(block, [t]) for t in ids[20:])])


def test_int4_model_is_its_dequantized_model(tiny_model, record_error):
    """The whole 4-bit path (prefill and decode, native modules where built) against the float32 model
    whose linears hold the dequantized weights (plain torch modules): float32 rounding apart. The
    lm_head (int8) is replaced by one float32 weight on both sides."""
    tm = tiny_model("llama")
    q = tm.runner(quantize="int4")
    layers = q.model.model.layers
    linear = layers[0].self_attn.qkv_proj
    assert isinstance(linear, Int4Linear) and isinstance(q.model.lm_head, Int8Linear)
    assert layers[0].self_attn.q_proj is None  # no dense copy of a quantized weight stays alive
    if native.available():
        assert isinstance(linear, NativeInt4Linear)  # the native backend swapped its module in
    dense = tm.runner(attention_backend="torch")
    for name, module in q.model.named_modules():
        if isinstance(module, Int4Linear):
            parent, _, attr = name.rpartition(".")
            old = dense.model.get_submodule(name)
            setattr(dense.model.get_submodule(parent), attr, type(old)(module.weights.dequantize(), None))
    # the lm_head (int8, activations rounded to bfloat16) as one float32 weight on both sides
    head = q.model.lm_head.dequantized(torch.float32)
    q.model.lm_head = NativeCpuLinear(head, None) if native.available() else CpuLinear(head, None)
    if q.fused_decode is not None:  # the fused step read the lm_head it had: it takes the new one
        q.fused_decode = FusedDecode.for_model(q.model)
        assert q.fused_decode is not None and q.fused_decode.head is not None
    dense.model.lm_head = CpuLinear(head.clone(), None)
    ids = random_ids(24, seed=7)
    got, want = _logits(q, ids), _logits(dense, ids)
    rel = record_error("int4 vs its dequantized fp32 model (relative)", "llama",
                       ((got - want).abs().max() / want.abs().max()).item())
    assert rel < 1e-4


def test_tiny_model_int4_stays_close_to_bfloat16(tiny_model, record_error):
    tm = tiny_model("llama")
    ids = random_ids(24, seed=7)
    want = _logits(tm.runner(dtype=torch.bfloat16), ids)
    got = _logits(tm.runner(dtype=torch.bfloat16, quantize="int4"), ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    record_error("int4 vs bf16 (relative)", "llama", rel)
    # Tolerance: random weights (no structure, every group spread over its whole range) are 4-bit's
    # worst case: 16 levels per group of 32 move this model's logits by ~30% of their range (the
    # error is the weights', not the kernels': the test above). Never garbage: most argmaxes agree.
    assert rel < 0.5
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.5


def test_int4_greedy_decoding_through_the_engine(tiny_model):
    async def run() -> list[int]:
        engine = cothink.Engine.from_pretrained(tiny_model("llama").folder, quantize="int4")
        async with engine:
            block = engine.block("q")
            await engine.extend(block, token_ids=random_ids(6, seed=9))
            result = await engine.generate(block, max_tokens=4, stop_at_eos=False).collect()
        return result.token_ids

    import asyncio

    assert len(asyncio.run(run())) == 4


def test_int4_refuses_unsupported_families(tiny_model):
    with pytest.raises(UnsupportedModelError, match="quantize"):
        tiny_model("qwen35").runner(quantize="int4")


def _smollm2_gguf() -> Path | None:
    try:
        from cothink.models.hub import find_embedded_gguf

        return find_embedded_gguf("smollm2")
    except Exception:  # the embedded model's package is not installed
        return None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="the embedded SmolLM2 package is not installed")
def test_smollm2_q4_1_tensors_load_exactly():
    """The shipped Q4_1 tensors, loaded as 4-bit weights, dequantize to the converted float32
    checkpoint's weights to the bit (q/k rows un-permuted as llama.cpp's converter permuted them);
    `quantize="int4"` on the embedded model takes them (the lm_head, Q8_0 there, becomes int8)."""
    from cothink.models.config import load_config
    from cothink.models.hub import resolve_model_path
    from cothink.models.weights import load_weights

    folder = resolve_model_path("smollm2")
    assert checkpoint_gguf(folder) == _smollm2_gguf()
    model = load_weights(load_config(folder), folder, torch.float32, "cpu")
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules()
             if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    assert load_gguf_int4(model, _smollm2_gguf()) == 4 * len(model.model.layers)
    quantized = load_weights(load_config(folder), folder, torch.bfloat16, "cpu", quantize="int4")
    assert isinstance(quantized.lm_head, Int8Linear)
    for loaded in (model, quantized):
        modules = dict(loaded.named_modules())
        for name, weight in dense.items():
            assert isinstance(modules[name], Int4Linear)
            assert torch.equal(modules[name].weights.dequantize(), weight), name


def test_plain_checkpoints_have_no_source_gguf(tiny_model):
    assert checkpoint_gguf(tiny_model("llama").folder) is None


@needs_pairs
def test_8bit_activations_switched_off_keep_the_plain_kernels(monkeypatch):
    """COTHINK_8BIT_ACTIVATIONS=0 (`native.ACTIVATIONS_8BIT`): int8 and 4-bit layers keep their plain
    weights (bfloat16 activations, NATIVE_MAX_ROWS rows in C: the definitions before the 8-bit
    activations); bfloat16 weights still go in pairs."""
    from cothink.execution.native_modules import NativeInt8Linear

    monkeypatch.setattr(native, "ACTIVATIONS_8BIT", False)
    torch.manual_seed(5)
    plain = Int4Linear(torch.randn(64, 96), None)
    four = NativeInt4Linear.of(plain, torch.bfloat16)
    assert four.operands()[0] is plain.weight_packed and four.native_rows == NATIVE_MAX_ROWS
    x = torch.randn(5, 96).bfloat16()
    exact = torch.nn.functional.linear(x.float(), plain.weights.dequantize())
    assert ((four(x).float() - exact).abs() <= _bound(x, plain.weights) + exact.abs() * 2.0**-8).all()
    eight = NativeInt8Linear(torch.randn(64, 96), None)
    assert eight.operands()[0] is eight.weight_int8 and eight.native_rows == NATIVE_MAX_ROWS
    want = (x.double() @ eight.weight_int8.double().T * eight.scale.double()).to(torch.bfloat16)
    assert ((eight(x).double() - want.double()).abs() <= want.double().abs() * 2.0**-7 + 1e-6).all()
    assert native.takes_pairs(torch.randn(64, 96).bfloat16())
