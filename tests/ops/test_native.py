"""cothink's fused C kernels (cothink.ops.native) against the torch ops they replace and the plain
float64 attention math; the build falling back to torch when there is no compiler."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from support import QUICK_KERNEL_BUILD

from cothink.models.quant4 import Int4Weights
from cothink.models.quantize import activation_bound, quantize_activations
from cothink.ops import native
from cothink.ops.attention import reference_merge, reference_partial_attention
from cothink.ops.rope import Rotary

pytestmark = pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16]


def _torch_norm(x, weight, eps, zero_centred):
    """models.RMSNorm's torch path."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (normed * (1.0 + weight.float())).type_as(x)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual_matches_torch(dtype, zero_centred):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 100, generator=g).to(dtype)
    x, residual = wide[:, :48], wide[:, 50:98]  # rows with a stride: read in place
    weight = (torch.randn(48, generator=g) * 0.1 + (0.0 if zero_centred else 1.0)).to(dtype)
    normed, same = native.rms_norm(x, weight, 1e-6, zero_centred)
    assert same is x
    summed_normed, total = native.rms_norm(x, weight, 1e-6, zero_centred, residual)
    assert torch.equal(total, x + residual)  # the add is rounded to the dtype as torch rounds it
    for got, inp in ((normed, x), (summed_normed, x + residual)):
        want = _torch_norm(inp, weight, 1e-6, zero_centred)
        if dtype == torch.bfloat16:  # a float result rounded to bf16: at most one unit apart
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
        else:  # the mean's summation order differs: float rounding
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 2 * 40, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps: silu -> 0, x, 0
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up).float(), (F.silu(gate) * up).float(),
                               atol=1e-6, rtol=2**-7 if dtype == torch.bfloat16 else 1e-6)


def _rotary(head_dim: int, partial: float = 1.0) -> Rotary:
    return Rotary(SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": partial}),
                  head_dim)


@pytest.mark.parametrize("partial", [1.0, 0.25])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_what_the_torch_path_writes(dtype, partial):
    """Keys rotated with Rotary.apply_prepared (bit for bit: same roundings) and values, to
    scattered pool slots, from k/v that are column slices of one projection output."""
    heads, d = 2, 16
    rotary = _rotary(d, partial)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 3 * heads * d, generator=g).to(dtype)
    k = qkv[:, heads * d : 2 * heads * d].view(5, heads, d)
    v = qkv[:, 2 * heads * d :].view(5, heads, d)
    cos, sin = rotary.prepared(torch.tensor([0, 3, 4, 90, 2]), dtype)
    slots = torch.tensor([7, 1, 12, 3, 8])
    pool_k, pool_v = torch.zeros(16, heads, d, dtype=dtype), torch.zeros(16, heads, d, dtype=dtype)
    native.store_kv(k, v, slots, cos, sin, pool_k, pool_v)
    want_k, want_v = torch.zeros_like(pool_k), torch.zeros_like(pool_v)
    want_k[slots] = rotary.apply_prepared(k, cos, sin)
    want_v[slots] = v
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)


@pytest.mark.parametrize("tokens", [20, 40])  # a decode-sized step's (the helpers) and a prefill chunk's
def test_store_kv_splits_tokens_over_threads_with_the_same_result(tokens):
    """A chunk's tokens split over threads (a grain of 16 each: on the helpers up to 32 tokens, on
    OpenMP's team past them) write what one thread writes, which is the torch path's."""
    heads, d, dtype = 3, 64, torch.bfloat16
    rotary = _rotary(d)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(tokens, heads, d, generator=g).to(dtype) for _ in range(2))
    cos, sin = rotary.prepared(torch.arange(tokens) * 3, dtype)
    slots = torch.randperm(2 * tokens, generator=g)[:tokens]
    pools = []
    for threads in (1, 2):
        pool_k, pool_v = (torch.zeros(2 * tokens, heads, d, dtype=dtype) for _ in range(2))
        with native.team_threads(threads):
            native.store_kv(k, v, slots, cos, sin, pool_k, pool_v)
            helped, deadline = native.helper_grains(), time.monotonic() + 60
            on_helpers = tokens <= 32 and threads > 1
            while on_helpers and native.helper_grains() <= helped and time.monotonic() < deadline:
                native.store_kv(k, v, slots, cos, sin, pool_k, pool_v)  # (the helpers join once awake)
            assert not on_helpers or native.helper_grains() > helped
        pools.append((pool_k, pool_v))
    want_k = torch.zeros_like(pools[0][0])
    want_k[slots] = rotary.apply_prepared(k, cos, sin)
    assert all(torch.equal(pk, want_k) and torch.equal(pv[slots], v) for pk, pv in pools)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_is_the_merge_of_per_run_attentions(dtype, partial):
    """Four items (two runs with a gather; one run; an empty run and a single key; a run of several
    passes of the kernel's 64 keys, not a multiple of 8), grouped-query heads, head size 80 (one 64-lane
    block and a 16-lane tail), a query with a head stride (a gated projection's layout): one softmax
    over the runs with the query rotated per run equals the float64 per-run attention merged by LSE."""
    hq, hkv, d = 6, 2, 80
    rotary = _rotary(d, partial)
    g = torch.Generator().manual_seed(3)
    pool_k = torch.randn(256, hkv, d, generator=g).to(dtype)
    pool_v = torch.randn(256, hkv, d, generator=g).to(dtype)
    q = torch.randn(5, hq, 2 * d, generator=g).to(dtype)[:, :, :d]  # head stride 2d
    runs = {
        0: [(torch.arange(0, 20), 27), (torch.tensor([40, 33, 35, 50]), 3)],
        2: [(torch.arange(20, 29), 8)],
        3: [(torch.arange(0, 0), 0), (torch.tensor([60]), 0)],
        4: [(torch.randperm(256, generator=g)[:150], 200), (torch.arange(100, 110), 9)],
    }
    plan_runs, want = [], {}
    for row, item in runs.items():
        prepared, outs, lses = [], [], []
        for slots, position in item:
            cos, sin = rotary.prepared(torch.tensor([position]), dtype)
            prepared.append((slots, cos, sin))
            if slots.numel():
                rotated = rotary.apply_prepared(q[row : row + 1], cos, sin)
                o, lse = reference_partial_attention(rotated, pool_k[slots], pool_v[slots], d**-0.5)
                outs.append(o)
                lses.append(lse)
        plan_runs.append(prepared)
        want[row] = reference_merge(outs, lses)
    out = torch.full((5, hq, d), float("nan"))
    native.decode_attention(q, native.DecodePlan(list(runs), plan_runs), pool_k, pool_v, d**-0.5, out)
    for row in runs:
        torch.testing.assert_close(out[row : row + 1], want[row], atol=2e-6, rtol=2e-6)
    assert out[1].isnan().all()  # rows of other items are left alone


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_runs_are_attended_once_for_all_their_readers(dtype, partial):
    """19 items read two shared blocks (A: gathered slots, B: a range) in either order, with runs of
    their own, each at its own position (its own rotation of the query per run); one block is read by
    one item only. Per item the result is the float64 merge of per-run attentions within float32
    rounding. Grouped (bfloat16 pools: each shared block attended once for all its readers, 16 per task,
    as the prefill kernel attends a block, then merged into each item's softmax): P rounded to bfloat16
    for P V moves each output by at most 2^-9 max|v| (plus float32 rounding), the prefill's bound;
    head size 80 takes the packing's 16-channel and 8-pair tails, the blocks' 130 and 80 keys its
    partial chunks."""
    hq, hkv, d, n = 6, 2, 80, 19
    rotary = _rotary(d, partial)
    g = torch.Generator().manual_seed(5)
    pool_k = torch.randn(400, hkv, d, generator=g).to(dtype)
    pool_v = torch.randn(400, hkv, d, generator=g).to(dtype)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    a, b, alone = torch.randperm(150, generator=g)[:130], torch.arange(150, 230), torch.arange(230, 240)
    runs, want = [], []
    for i in range(n):
        own = torch.arange(240 + 8 * i, 240 + 8 * i + 1 + i % 8)
        item = [(a, "A", 140 + i), (own, None, i % 8)]
        if i % 3 == 0:  # the other order, and a second shared block
            item = [(own, None, 3), (b, "B", 90 + i), (a, "A", i)]
        if i == 4:
            item.append((alone, "C", 12))
        prepared, outs, lses = [], [], []
        for slots, key, position in item:
            cos, sin = rotary.prepared(torch.tensor([position]), dtype)
            prepared.append((slots, cos, sin, key))
            rotated = rotary.apply_prepared(q[i : i + 1], cos, sin)
            o, lse = reference_partial_attention(rotated, pool_k[slots], pool_v[slots], d**-0.5)
            outs.append(o)
            lses.append(lse)
        runs.append(prepared)
        want.append(reference_merge(outs, lses))
    grouped = native.DecodePlan(list(range(n)), runs, shared_min_keys=16)
    assert grouped.groups == 2  # A and B; C has one reader
    per_item = native.DecodePlan(list(range(n)), runs, shared_min_keys=1000)
    assert per_item.groups == 0
    for plan in (grouped, per_item):
        out = torch.empty(n, hq, d)
        native.decode_attention(q, plan, pool_k, pool_v, d**-0.5, out)
        if plan is grouped and dtype == torch.bfloat16 and native.bf16_dot():
            bound = 2**-9 * pool_v.float().abs().max().item() + 1e-5
            assert (out - torch.cat(want)).abs().max().item() <= bound
        else:
            torch.testing.assert_close(out, torch.cat(want), atol=2e-6, rtol=2e-6)


def test_a_shared_context_of_one_chunk_is_attended_once_by_default():
    """A run several items read is grouped from native.SHARED_MIN_KEYS keys, one chunk of the kernel's
    (the grouped path measured at least even with the per-item one from there: 32 coroutines over a
    256-token context attend it once); a shorter run stays with each item."""
    table = torch.zeros(1, 1, 16)

    def plan(keys: int) -> native.DecodePlan:
        return native.DecodePlan([0, 1], [[(torch.arange(keys), table, table, "ctx"),
                                           (torch.tensor([keys + i]), table, table, None)] for i in range(2)])

    assert native.SHARED_MIN_KEYS == 64
    assert plan(64).groups == 1 and plan(64).grouped_reads == 64
    assert plan(63).groups == 0 and plan(63).grouped_reads == 0


_PREFILL = pytest.mark.skipif(
    not native.prefill_attention_fits(*(torch.zeros(2, 2, 16, dtype=torch.bfloat16) for _ in range(3))),
    reason="the prefill attention kernel is built only where the CPU has AVX-512 BF16")


@_PREFILL
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,earlier", [(False, 45), (True, 0), (True, 1), (True, 70)])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 80), (9, 3, 64), (4, 4, 16), (16, 2, 128)])
def test_prefill_attention_matches_the_float64_math(causal, earlier, hq, hkv, d, dtype):
    """A prefill chunk's rows over one run, visible or causal with earlier keys (row t sees keys
    0..earlier+t), grouped-query heads, head sizes of one 64-lane block with a 16-lane tail, 16 and
    128; key and value runs with a row stride (views of a pool), keys not a multiple of the kernel's
    64-key blocks: float32 scores and softmax (the log-sum-exp within float32 rounding of the float64
    reference); bfloat16: P rounded to bfloat16 for P V as torch's flash kernel rounds it, each weight
    off by at most 2^-9 of itself, so each output by at most 2^-9 max|v| (plus float32 rounding);
    float32: P V in float32, each output within float32 rounding."""
    t = 37
    g = torch.Generator().manual_seed(hq * d + earlier)
    length = earlier + t if causal else earlier
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    pool_k, pool_v = (torch.randn(length + 9, hkv, d, generator=g).to(dtype) for _ in range(2))
    k, v = pool_k[5 : 5 + length], pool_v[4 : 4 + length]
    assert native.prefill_attention_fits(q, k, v)
    out, lse = native.prefill_attention(q, k, v, d**-0.5, causal)
    want, want_lse = reference_partial_attention(q, k, v, d**-0.5, causal)
    rounding = 2**-9 if dtype == torch.bfloat16 else 2**-20
    bound = rounding * v.float().abs().max().item() + 1e-5
    assert (out - want).abs().max().item() <= bound
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=2e-6)


@_PREFILL
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_prefill_attention_rotates_queries_as_the_torch_path(partial, dtype):
    """Queries given unrotated with the run's tables (a column slice of one projection's rows, as the
    model hands them over): the same bits as the kernel over Rotary.apply_prepared's rotated copy,
    whole and partial rotary; a lone run's output written into rows of a larger tensor; an out of the
    wrong shape refused."""
    hq, hkv, d, t = 9, 3, 64, 70
    rotary = _rotary(d, partial)
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k, v = (torch.randn(t + 20, hkv, d, generator=g).to(dtype) for _ in range(2))
    cos, sin = rotary.prepared(torch.arange(20, 20 + t), dtype)
    want, want_lse = native.prefill_attention(rotary.apply_prepared(q, cos, sin), k, v, 0.125, True)
    whole = torch.full((t + 3, hq, d), 7.0)
    out, lse = native.prefill_attention(q, k, v, 0.125, True, rotation=(cos, sin), out=whole[2 : 2 + t])
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(whole[2 : 2 + t], want) and (whole[:2] == 7).all() and (whole[2 + t :] == 7).all()
    with pytest.raises(ValueError, match="out must be"):
        native.prefill_attention(q, k, v, 0.125, True, out=whole)


@_PREFILL
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_does_not_depend_on_the_thread_count(torch_threads, dtype):
    """Tasks (a key head, a block of tokens) are computed whole by one thread: 1, 2 and 3 threads give
    the same bits."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(50, 8, 64, generator=g).to(dtype)
    k, v = (torch.randn(300, 2, 64, generator=g).to(dtype) for _ in range(2))
    results = []
    for threads in (1, 2, 3):
        torch_threads(threads)
        results.append(native.prefill_attention(q, k, v, 0.125, True))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("k", [48, 144, 128])  # blocks of 32 and 64 along k, what is left, AMX tiles
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_the_float32_product_rounded_once(dtype, k):
    """Row counts below, at and across the kernel's groups of 8 (1, 8, 9, 17), with and without a
    bias, an input with a row stride: float32 within float tolerance of float64, bfloat16 within one
    rounding of it; every row the same to the bit alone as in the batch; `float_out` the same values
    in float32."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, k, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    x_all = torch.randn(17, 2 * k, generator=g).to(dtype)[:, :k]  # row stride 2k
    assert native.linear_fits(w, b) and not native.linear_fits(w[:, :40].contiguous(), None)
    for rows in (1, 8, 9, 17):
        x = x_all[:rows]
        for bias in (None, b):
            got = native.linear(x, w, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert got.dtype == dtype and got.shape == (rows, 70)
            if dtype == torch.bfloat16:
                assert ((got.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
            else:
                assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
            assert torch.equal(native.linear(x[-1:], w, bias), got[-1:])
            wide = native.linear(x, w, bias, float_out=True)  # the logits' form: float32, same values
            assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    with pytest.raises(ValueError, match="does not fit"):  # the C kernel would read past the rows
        native.linear(x_all[:, :32], w, None)


@pytest.mark.skipif(not native.bf16_pairs(), reason="bfloat16 pairs: CPUs with AVX-512 BF16 and no AMX tiles")
@pytest.mark.parametrize("k", [48, 144, 576])
def test_bfloat16_pairs_are_the_float32_product_rounded_once(k):
    """A bfloat16 weight in pairs (`pack_pairs`: the same bytes, tiles of PAIR_TILE outputs): row
    counts below, at and across groups of 8 up to NATIVE_MAX_ROWS and across the GEMM of wider steps
    (from 24 rows: blocks of 48 rows, six at a time, panels of two tiles and an odd tile's half
    panel), with and without a bias, an input with a row stride, three tiles: the float32 sum (within
    the summation bound) rounded to bfloat16 once, against the float64 product; every row the same to
    the bit alone as in the batch (a prefill chunk's products are a decode step's); `float_out` the
    same values. Weights that do not fit the layout are refused."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(3 * native.PAIR_TILE, k, generator=g).to(torch.bfloat16)
    b = torch.randn(w.shape[0], generator=g).to(torch.bfloat16)
    pairs = native.pack_pairs(w)
    assert pairs.dtype == torch.int32 and pairs.shape == (w.shape[0], k // 2)
    # pair p of output o of tile t sits at [t, p, o]: (w[o][2p], w[o][2p + 1])
    tiles = pairs.view(torch.bfloat16).reshape(3, k // 2, native.PAIR_TILE, 2)
    assert torch.equal(tiles[1, 3, 5], w[native.PAIR_TILE + 5, 6:8])
    assert torch.equal(native.unpack_pairs(pairs), w)  # the same bytes, back in their order
    assert native.linear_fits(pairs, b) and not native.linear_fits(pairs, b.float())
    x_all = torch.randn(101, 2 * k, generator=g).to(torch.bfloat16)[:, :k]  # row stride 2k
    for rows in (1, 8, 9, 17, 23, 24, 32, 33, 49, 101):
        x = x_all[:rows]
        for bias in (None, b):
            got = native.linear(x, pairs, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            sums = F.linear(x.double().abs(), w.double().abs())  # float32 summation: k 2^-24 of it
            assert got.dtype == torch.bfloat16 and got.shape == (rows, w.shape[0])
            assert ((got.double() - ref).abs() <= ref.abs() * 2**-8 + sums * k * 2**-24 + 1e-6).all()
            for row in {0, rows // 2, rows - 1}:
                assert torch.equal(native.linear(x[row:row + 1], pairs, bias), got[row:row + 1])
            wide = native.linear(x, pairs, bias, float_out=True)
            assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x_all.float(), pairs, None)  # pairs take bfloat16 rows only
    with pytest.raises(ValueError, match="pack_pairs"):
        native.pack_pairs(w[:40])  # not whole tiles


@pytest.mark.skipif(not native.bf16_pairs(), reason="bfloat16 pairs: CPUs with AVX-512 BF16 and no AMX tiles")
def test_bfloat16_pairs_deal_a_decode_steps_panels_to_the_threads(torch_threads):
    """A step of 24 to 48 rows (many coroutines' decode) takes a bfloat16 weight in pairs panel by panel,
    its tiles dealt to the threads (9 tiles on 2 threads: 4 panels of two tiles and one tile; on 3: 3
    and 3), each thread prefetching its next panel, the panels left taken by whichever thread is free:
    every row the same to the bit as alone, on 1, 2 and 3 threads."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(9 * native.PAIR_TILE, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(w.shape[0], generator=g).to(torch.bfloat16)
    pairs = native.pack_pairs(w)
    x = torch.randn(48, 96, generator=g).to(torch.bfloat16)
    alone = torch.cat([native.linear(x[r:r + 1], pairs, b) for r in range(48)])
    for threads in (1, 2, 3):
        torch_threads(threads)
        for rows in (24, 31, 48):
            assert torch.equal(native.linear(x[:rows], pairs, b), alone[:rows]), (threads, rows)


@pytest.mark.skipif(not native.f32_tiles(), reason="float32 tiles: CPUs with AVX-512")
@pytest.mark.parametrize("k", [48, 576])
def test_float32_tiles_are_the_float32_product(k, torch_threads, monkeypatch):
    """A float32 weight in tiles (`pack_f32_tiles`: tiles of PAIR_TILE outputs, the last padded with
    zeros; 70 outputs, two tiles and 6 of a third): row counts below, at and across the kernel's groups
    of 12 up to past NATIVE_MAX_ROWS, with and without a bias, an input with a row stride: the float32
    sum within its summation bound of the float64 product; every row the same to the bit alone as in
    the batch and on 1, 2 or 3 threads; `float_out` the same values. Misfits are refused;
    COTHINK_F32_TILES=0 (the module's F32_TILES) keeps the plain weight."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(70, k, generator=g)
    b = torch.randn(70, generator=g)
    tiles = native.pack_f32_tiles(w)
    assert tiles.shape == (3, k, native.PAIR_TILE) and native.weight_kind(tiles, None) == native.WT_F32_TILES
    # output o of tile t, input e, at [t, e, o]; the padding zeros
    assert torch.equal(tiles[1, 5, 3], w[native.PAIR_TILE + 3, 5]) and not tiles[2, :, 6:].any()
    assert native.linear_fits(tiles, b) and not native.linear_fits(tiles, b.bfloat16())
    x_all = torch.randn(33, 2 * k, generator=g)[:, :k]  # row stride 2k
    for rows in (1, 8, 11, 12, 13, 25, 32, 33):
        x = x_all[:rows]
        for bias in (None, b):
            got = native.linear(x, tiles, bias, n=70)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            sums = F.linear(x.double().abs(), w.double().abs())  # float32 summation: k 2^-24 of it
            assert got.dtype == torch.float32 and got.shape == (rows, 70)
            assert ((got.double() - ref).abs() <= sums * (k + 1) * 2**-24 + 1e-6).all()
            assert torch.equal(native.linear(x[-1:], tiles, bias, n=70), got[-1:])
            wide = native.linear(x, tiles, bias, float_out=True, n=70)
            assert torch.equal(wide, got)
    batch = native.linear(x_all, tiles, b, n=70)
    for threads in (1, 2, 3):
        torch_threads(threads)
        assert torch.equal(native.linear(x_all, tiles, b, n=70), batch)
    assert native.linear(x_all, tiles, None).shape == (33, 3 * native.PAIR_TILE)  # n: every tile's outputs
    for misfit in (dict(n=64), dict(n=97), dict(n=70, bias=b[:64])):  # n within the last tile; a bias of n
        with pytest.raises(ValueError, match="does not fit"):
            native.linear(x_all, tiles, misfit.pop("bias", None), **misfit)
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x_all.bfloat16(), tiles, None, n=70)  # tiles take float32 rows only
    with pytest.raises(ValueError, match="pack_f32_tiles"):
        native.pack_f32_tiles(w[:, :40])  # K not a multiple of 16
    assert native.takes_f32_tiles(w) and not native.takes_f32_tiles(w.bfloat16())
    monkeypatch.setattr(native, "F32_TILES", False)
    assert not native.takes_f32_tiles(w)


def _assert_int8_product(x, weight, q, scale, bias, taken=None) -> None:
    """`native.linear` of `weight` (q itself, or q in pairs) is the int8 product's definition: x rounded
    to bfloat16 (or `taken`, the x the kernel takes), the float32 sum times the scale rounded to
    bfloat16, then the bias in x's dtype (within float32 summation and one rounding); the last row alone
    the same to the bit."""
    got = native.linear(x, weight, bias, scale=scale)
    taken = x.to(torch.bfloat16).double() if taken is None else taken
    prod = F.linear(taken, q.double()) * scale.double()
    ref = prod.to(torch.bfloat16).to(x.dtype).double() + (0 if bias is None else bias.double())
    assert got.dtype == x.dtype
    assert ((got.double() - ref).abs() <= prod.abs() * 2**-7 + ref.abs() * 2**-8 + 1e-5).all()
    assert torch.equal(native.linear(x[-1:], weight, bias, scale=scale), got[-1:])


@pytest.mark.parametrize("k", [48, 144, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_is_the_scaled_product_of_the_rounded_input(dtype, k):
    """int8 weights with a bfloat16 scale per row: x rounded to bfloat16, the float32 sum times the
    scale rounded to bfloat16, then the bias in x's dtype; each row alone as in the batch. Scales,
    biases or dtypes that do not fit the kernel are refused."""
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (70, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(70, generator=g) / 50).to(torch.bfloat16)
    b = torch.randn(70, generator=g).to(dtype)
    x = torch.randn(17, k, generator=g).to(dtype)
    assert native.linear_fits(q, b, scale) and not native.linear_fits(q, b, scale.float())
    for bias in (None, b):
        _assert_int8_product(x, q, q, scale, bias)
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x, q, None)  # int8 without its scales
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x, q, None, scale=scale[:-1])  # the C kernel would read past the scales
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x, q, b.to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16), scale=scale)


@pytest.mark.skipif(not native.bf16_pairs(), reason="int8 pairs: CPUs with AVX-512 BF16 and no AMX tiles")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [160, 576])
def test_int8_pairs_are_the_int8_product_of_the_8bit_input(dtype, k):
    """An int8 weight in pairs (`pack_pairs`: int16, the same bytes, each plus 128, in tiles of PAIR_TILE
    outputs, each output's four weights of four inputs together; K a multiple of 32) takes x as 8-bit
    codes per group of 32 (models/quant4.py `quantize_activations`):
    the int8 product's definition (the float32 sum times the scale rounded to bfloat16, the bias) of
    those codes times their scales, at row counts up to and past NATIVE_MAX_ROWS, every row the same to
    the bit alone as in the batch, and within models/quantize.py's bound of the product of x itself.
    K = 576: 18 groups, which the kernel quantizes 16 at a time and then the 2 left one by one."""
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (2 * native.PAIR_TILE, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(q.shape[0], generator=g) / 50).to(torch.bfloat16)
    b = torch.randn(q.shape[0], generator=g).to(dtype)
    pairs = native.pack_pairs(q)
    assert pairs.dtype == torch.int16 and pairs.shape == (q.shape[0], k // 2)
    unsigned = pairs.view(torch.uint8).reshape(2, k // 4, native.PAIR_TILE, 4)[1, 3, 5].int()
    assert torch.equal(unsigned - 128, q[native.PAIR_TILE + 5, 12:16].int())  # tile 1, inputs 12-15, output 5
    assert native.linear_fits(pairs, b, scale) and not native.linear_fits(pairs, b, None)
    assert native.takes_pairs(q) and not native.takes_pairs(q[:, :144].contiguous())  # K % 32
    for rows in (1, 9, 32, 33, 70):
        x = torch.randn(rows, k, generator=g).to(dtype)
        x[0, 32:64] = 0  # a group of zeros: scale 0, codes 0
        x[-1, k - 32:] = 0  # and one among the groups left after the kernel's blocks of 16
        codes, d = quantize_activations(x.to(torch.bfloat16))
        taken = (codes.double().view(rows, -1, 32) * d.double()[..., None]).view(rows, k)
        for bias in (None, b):
            _assert_int8_product(x, pairs, q, scale, bias, taken)
        got = native.linear(x, pairs, None, scale=scale).double()
        exact = F.linear(x.to(torch.bfloat16).double(), q.double()) * scale.double()
        bound = activation_bound(x, q.double() * scale.double()[:, None]) + exact.abs() * 2**-7 + 1e-5
        assert ((got - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="does not fit"):
        native.linear(x, pairs, None)  # int8 pairs without their scales


def _probe(env: dict[str, str]) -> str:
    code = (
        "import torch; from cothink.ops import native\n"
        "from cothink.execution.native_modules import NativeRMSNorm\n"
        "n = NativeRMSNorm(8, 1e-6)\n"
        "print(native.available(), round(n(torch.ones(2, 8)).sum().item(), 3))"
    )
    # the fallback under test, also where the suite runs with COTHINK_REQUIRE_NATIVE=1 (CI)
    env = {**os.environ, "COTHINK_REQUIRE_NATIVE": "0", **env}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() + "\n" + done.stderr


def test_without_a_compiler_or_switched_off_the_torch_paths_run(tmp_path):
    out = _probe({"CC": "/bin/false", "COTHINK_CACHE": str(tmp_path)})
    assert out.startswith("False 16.0") and "native kernels off" in out
    assert not list(tmp_path.glob("native/*.so"))
    assert _probe({"COTHINK_NATIVE": "0"}).startswith("False 16.0")
    built = _probe({"COTHINK_CACHE": str(tmp_path), "COTHINK_NATIVE_CFLAGS": QUICK_KERNEL_BUILD})
    assert built.startswith("True 16.0")
    assert len(list(tmp_path.glob("native/native-*.so"))) == 1  # built once, named for source, compiler, CPU


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="the CPU has no AVX-512: the suite runs the portable kernels")
def test_the_portable_products_where_the_cpu_has_avx512(tmp_path):
    """The products' portable kernels (8-lane vectors), built here without AVX-512: the same
    properties the tests above ask of the AVX-512 ones (a separate build, named by its flags)."""
    env = {**os.environ, "COTHINK_NATIVE_CFLAGS": "-mno-avx512f", "COTHINK_CACHE": str(tmp_path),
           "COTHINK_REQUIRE_NATIVE": "1"}
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-k", "linear or thread_count or kernel_within_bound",
         str(tests / "ops" / "test_native.py"), str(tests / "models" / "test_quant4.py")],
        env=env, capture_output=True, text=True, timeout=600, cwd=tests.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and len(list(tmp_path.glob("native/native-*.so"))) == 1


@pytest.fixture
def torch_threads():
    """set(n): this thread's torch thread count, which the kernels split their work over; restored."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count(dtype, torch_threads):
    """Weight rows (products), items (decode attention; an item's key heads where the items are fewer
    than the threads) and rows (norms, SiLU x up, 4-bit dequantization, on OpenMP's team) split over
    threads: each task is computed whole by one thread in a fixed order, so 1, 2 and 3 threads give
    the same bits; the helpers do take part."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(4096, 64, generator=g).to(dtype)  # 128 grains of weight rows
    x = torch.randn(3, 64, generator=g).to(dtype)
    pool_k, pool_v = (torch.randn(64, 2, 32, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(24, 4, 32, generator=g).to(dtype)
    rotary = _rotary(32, 1.0)
    runs = [[(torch.randperm(64, generator=g)[: 10 + i], *rotary.prepared(torch.tensor([i]), dtype))]
            for i in range(24)]
    plan = native.DecodePlan(list(range(24)), runs)
    # fewer items than threads (one at 2 and 3 threads, two at 3): a task per item and key head
    few = [native.DecodePlan(list(range(n)), runs[:n]) for n in (1, 2)]
    rows, residual = (torch.randn(100, 64, generator=g).to(dtype) for _ in range(2))  # 7 grains of rows
    norm_weight = torch.randn(64, generator=g).to(dtype)
    gate_up = torch.randn(100, 128, generator=g).to(dtype)
    four_bit = Int4Weights.quantize(torch.randn(300, 64, generator=g))
    results = {}
    helped = native.helper_grains()
    for threads in (1, 2, 3):
        torch_threads(threads)
        for _ in range(20):  # helpers wake up, then join as the calls follow each other
            y = native.linear(x, w, None)
            out = torch.empty(24, 4, 32)
            native.decode_attention(q, plan, pool_k, pool_v, 32**-0.5, out)
            few_out = [torch.empty(24, 4, 32) for _ in few]
            for p, o in zip(few, few_out):
                native.decode_attention(q, p, pool_k, pool_v, 32**-0.5, o)
        assert torch.equal(few_out[0][:1], out[:1]) and torch.equal(few_out[1][:2], out[:2])
        dequantized = torch.empty(300, 64, dtype=dtype)
        native.q4_dequant(four_bit.packed, four_bit.scale, slice(0, 300), dequantized)
        results[threads] = (y, out, *native.rms_norm(rows, norm_weight, 1e-6, False, residual),
                            native.silu_mul(gate_up), dequantized)
    # helpers take part once the scheduler gives them a core: on a loaded machine the calling thread
    # may take every grain for a while, so keep calling (bounded) until one is seen
    deadline = time.monotonic() + 60
    while native.helper_grains() <= helped and time.monotonic() < deadline:
        assert torch.equal(native.linear(x, w, None), results[1][0])
    assert native.helper_grains() > helped
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(results[threads], results[1]))


def test_team_threads_sets_the_kernels_count_for_this_thread_only(torch_threads):
    """`team_threads(n)`: within it, this thread's kernel calls split over n threads whatever torch's
    count (a step on the event loop keeps torch on one thread); it nests, restores, and another
    thread keeps torch's count. The helpers run a product's grains when it asks for two with torch at one."""
    import threading

    torch_threads(1)
    assert native._threads() == 1
    with native.team_threads(2):
        assert native._threads() == 2 and torch.get_num_threads() == 1
        other: list[int] = []
        t = threading.Thread(target=lambda: other.append(native._threads()))
        t.start()
        t.join()
        assert other == [torch.get_num_threads()]
        with native.team_threads(3):
            assert native._threads() == 3
        assert native._threads() == 2
        g = torch.Generator().manual_seed(5)
        x, w = torch.randn(4, 256, generator=g), torch.randn(512, 256, generator=g)
        helped, deadline = native.helper_grains(), time.monotonic() + 60
        while native.helper_grains() <= helped and time.monotonic() < deadline:  # (a loaded machine)
            assert torch.allclose(native.linear(x, w, None), x @ w.T, atol=1e-4)
        assert native.helper_grains() > helped
    assert native._threads() == 1


def test_a_forked_child_runs_the_kernels_without_the_parents_threads(torch_threads):
    """A fork copies the helper team's state but not its threads: the child must not wait for them.
    The attentions run on OpenMP's team, which (libgomp, as for torch's own ops) does not survive a
    fork: a child runs them, like torch's ops, on one thread."""
    torch_threads(2)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(4096, 64, generator=g), torch.randn(1, 64, generator=g)
    pool_k, pool_v = (torch.randn(64, 2, 32, generator=g) for _ in range(2))
    q = torch.randn(24, 4, 32, generator=g)
    rotary = _rotary(32, 1.0)
    plan = native.DecodePlan(list(range(24)), [[(torch.arange(40), *rotary.prepared(torch.tensor([i]),
                                                                                    torch.float32))]
                                               for i in range(24)])

    def attention() -> torch.Tensor:
        out = torch.empty(24, 4, 32)
        native.decode_attention(q, plan, pool_k, pool_v, 32**-0.5, out)
        return out

    want = native.linear(x, w, None), attention()  # the parent's threads exist now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 if the results are right, killed by the alarm if it hangs
        import signal

        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not the parent's (pytest-timeout's) handler
        signal.alarm(60)
        ok = all(torch.equal(native.linear(x, w, None), want[0]) for _ in range(5))
        torch.set_num_threads(1)
        ok = ok and torch.equal(attention(), want[1])
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_attentions_run_on_torchs_openmp_team():
    """One team of threads for the attentions and torch's ops on the same thread: in a fresh process
    whose torch ops have started their threads, decode attentions on two threads (helpers taking part)
    start no thread of their own (a team of ours beside torch's made each wait on the other's spinning
    threads)."""
    code = (
        "import os, torch\n"
        "from cothink.ops import native\n"
        "from types import SimpleNamespace\n"
        "from cothink.ops.rope import Rotary\n"
        "torch.set_num_threads(2)\n"
        "config = SimpleNamespace(rope_parameters={'rope_theta': 1e4, 'partial_rotary_factor': 1.0})\n"
        "rotary = Rotary(config, 32)\n"
        "plan = native.DecodePlan(list(range(24)), [[(torch.arange(40), *rotary.prepared(torch.tensor([i]),"
        " torch.float32))] for i in range(24)])\n"
        "q, k, v, out = torch.randn(24, 4, 32), torch.randn(64, 2, 32), torch.randn(64, 2, 32), "
        "torch.empty(24, 4, 32)\n"
        "torch.ones(1 << 22).exp_().sum()\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "for _ in range(1000):\n"
        "    native.decode_attention(q, plan, k, v, 32**-0.5, out)\n"
        "    if native.helper_grains():\n"
        "        break\n"
        "print(native.helper_grains() > 0, len(os.listdir('/proc/self/task')) - before)\n"
    )
    if not Path("/proc/self/task").exists():
        pytest.skip("counts threads in /proc")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True 0"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_is_the_gated_delta_nets_output_norm(dtype):
    """As models.GatedRMSNorm (its torch path) on value heads, with the gate a slice of wider rows
    (the fused input projection's): float32 to float rounding, bfloat16 to one rounding."""
    from cothink.models.transformer import GatedRMSNorm

    g = torch.Generator().manual_seed(9)
    norm = GatedRMSNorm(16, 1e-6)
    norm.weight.data = torch.randn(16, generator=g)
    norm = norm.to(dtype)
    x = torch.randn(3, 4, 16, generator=g).to(dtype)
    wide = torch.randn(3, 100, generator=g).to(dtype)
    z = wide[:, 20:84].reshape(3, 4, 16)  # token stride 100, heads contiguous
    want = norm(x, z)
    got = native.gated_rms_norm(x, z, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert ((got.float() - want.float()).abs() <= tol * (want.float().abs() + 1e-3)).all()
    from cothink.execution.native_modules import NativeGatedRMSNorm

    fast = NativeGatedRMSNorm(16, norm.eps).to(dtype)
    fast.weight = norm.weight  # the native backend's module takes the kernel for such inputs
    assert torch.equal(fast(x, z), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates_are_the_gated_delta_nets_to_float_rounding(dtype):
    """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) (rounded to the dtype) for b and a
    that are columns of wider rows (the fused input projection's), both sides of softplus's threshold."""
    g = torch.Generator().manual_seed(10)
    wide = (torch.randn(5, 40, generator=g) * 20).to(dtype)
    b, a = wide[:, 10:18], wide[:, 18:26]
    a_log, dt_bias = torch.randn(8, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
    decay, beta = native.gdn_gates(b, a, a_log, dt_bias)
    want_decay = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    assert (a.float() + dt_bias.float() > 20).any() and decay.dtype == beta.dtype == torch.float32
    assert ((decay - want_decay).abs() <= 1e-6 * want_decay.abs() + 1e-7).all()
    assert ((beta - b.sigmoid().float()).abs() <= 2**-8 * beta).all()  # one dtype rounding at most


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm_normalises_each_head_of_a_strided_view(dtype, zero_centred):
    """The q/k norms of Qwen3 / Qwen3.5 on a view of the q/k/v projection (token stride 100, head
    stride 32: the query halves of gated heads): each head as a row of models.RMSNorm's torch path,
    to float rounding (float32) or one rounding (bfloat16); the fast path's module takes the kernel."""
    from cothink.models.transformer import RMSNorm

    g = torch.Generator().manual_seed(11)
    norm = RMSNorm(16, 1e-6, zero_centred)
    norm.weight.data = torch.randn(16, generator=g)
    norm = norm.to(dtype)
    wide = torch.randn(3, 100, generator=g).to(dtype)
    x = wide[:, 4:100].reshape(3, 3, 32)[:, :, :16]  # [3 tokens, 3 heads, 16]
    want = norm(x)
    got = native.head_rms_norm(x, norm.weight, norm.eps, zero_centred)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert ((got.float() - want.float()).abs() <= tol * (want.float().abs() + 1e-3)).all()
    # each head is the row kernel's result for that head alone
    rows = native.rms_norm(x.contiguous().reshape(9, 16), norm.weight, norm.eps, zero_centred)[0]
    assert torch.equal(got.reshape(9, 16), rows)
    from cothink.execution.native_modules import NativeRMSNorm

    fast = NativeRMSNorm(16, norm.eps, zero_centred).to(dtype)
    fast.weight = norm.weight
    assert torch.equal(fast(x), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_is_the_attention_output_gate(dtype):
    """Qwen3.5's out * sigmoid(gate), the gate the second half of each head of the q projection
    (token stride 70, head stride 16): to float rounding (float32), one rounding (bfloat16)."""
    g = torch.Generator().manual_seed(12)
    wide = (torch.randn(2, 70, generator=g) * 4).to(dtype)
    gate = wide[:, 6:70].reshape(2, 4, 16)[:, :, 8:]  # [2 tokens, 4 heads, 8]
    out = torch.randn(2, 32, generator=g).to(dtype)
    got = native.sigmoid_gate(out, gate)
    want = out * torch.sigmoid(gate.reshape(2, 32))
    assert got.dtype == dtype and got.shape == out.shape
    tol = 2e-7 if dtype == torch.float32 else 2**-7
    assert ((got.float() - want.float()).abs() <= tol * (want.float().abs() + 1e-6)).all()


def test_the_fused_steps_structs_match_the_librarys():
    """ct_decode_layers takes named structs; native.py's ctypes mirrors agree with native.c on every
    field's offset and every struct's size (checked at load: a mismatch switches the kernels off)."""
    import ctypes

    lib = native._library()
    assert native.layout_mismatches(lib) == []

    class CtLinear(ctypes.Structure):  # two fields swapped on one side only
        _fields_ = [("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("scale", ctypes.c_void_p)]

    class CtShape(ctypes.Structure):  # a field dropped on one side only
        _fields_ = [(name, kind) for name, kind in native.CtShape._fields_ if name != "conv_kernel"]

    drift = native.layout_mismatches(lib, (CtLinear, CtShape))
    assert any(d.startswith("CtLinear.bias:") for d in drift)
    assert any(d.startswith("CtLinear.scale:") for d in drift)
    assert any(d.startswith("CtShape.conv_kernel:") for d in drift)
    assert any(d.startswith("CtShape.eps:") for d in drift)  # the fields after it moved
    assert any(d.startswith("CtShape:") for d in drift)  # its size
