"""cothink.ops.attention on random tensors: the LSE merge, the padded decode batch, kernels vs the math."""

from __future__ import annotations

import pytest
import torch

from cothink.ops.attention import (
    merge_grouped,
    merge_partials,
    padded_attention,
    partial_attention,
    reference_merge,
    reference_partial_attention,
)

ATOL = 2e-6
D = 16


def _qkv(t: int, lengths: list[int], hq: int, hkv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, D, generator=gen)
    ks = [torch.randn(n, hkv, D, generator=gen) for n in lengths]
    vs = [torch.randn(n, hkv, D, generator=gen) for n in lengths]
    return q, ks, vs


def _masked_math(q, k, v, visible: torch.Tensor):
    """float64 softmax attention of q [T, Hq, D] over k, v [L, Hkv, D] with an explicit [T, L] mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * D**-0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("writer_one_run", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_lse_merge_equals_one_attention_over_concatenated_keys(hq, hkv, writer_one_run):
    """Visible runs of other blocks and the writer block (its old tokens and its causal new tokens,
    as two runs or as one causal run), each attended alone and merged by LSE, give one masked
    attention over all keys."""
    t, lengths = 5, [7, 1, 12]  # includes a run of one key
    q, ks, vs = _qkv(t, [*lengths, t], hq, hkv, seed=hq * 10 + hkv)
    if writer_one_run:  # the writer's 12 old keys and its t new ones: one run
        ks, vs = [*ks[:-2], torch.cat(ks[-2:])], [*vs[:-2], torch.cat(vs[-2:])]
    outs, lses = [], []
    for i, (k, v) in enumerate(zip(ks, vs)):
        o, lse = partial_attention(q, k, v, D**-0.5, causal=i == len(ks) - 1)
        outs.append(o)
        lses.append(lse)
    merged = merge_partials(outs, lses)

    total = sum(lengths)
    visible = torch.ones(t, total + t, dtype=torch.bool)
    visible[:, total:] = torch.ones(t, t, dtype=torch.bool).tril()
    want = _masked_math(q, torch.cat(ks), torch.cat(vs), visible)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(reference_merge(outs, lses).double(), want, atol=ATOL, rtol=0)
    # the merged LSE is the LSE of the whole: exp-weights sum to one, so a single run merges to itself
    assert merge_partials(outs[:1], lses[:1]) is outs[0]


@pytest.mark.parametrize("causal,earlier", [(False, 13), (True, 0), (True, 1), (True, 13)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (8, 1), (2, 2)])
def test_kernel_matches_reference_math(causal, earlier, hq, hkv):
    """A visible run of 13 keys, a square causal run, and causal runs with 1 or 13 earlier keys (row i
    sees keys 0..earlier+i): folded query heads, the kernel's own causal flag, the additive mask."""
    t = 9
    q, (k,), (v,) = _qkv(t, [earlier + t if causal else earlier], hq, hkv, seed=3)
    out, lse = partial_attention(q, k, v, D**-0.5, causal)
    ref_out, ref_lse = reference_partial_attention(q, k, v, D**-0.5, causal)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)
    visible = torch.ones(t, k.shape[0], dtype=torch.bool)
    if causal:
        visible = visible.tril(earlier)
    torch.testing.assert_close(out.double(), _masked_math(q, k, v, visible), atol=ATOL, rtol=0)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (3, 3)])
def test_padded_attention_equals_attention_per_run(hq, hkv):
    """One query per run, runs of different lengths (one of a single key) padded to a common width:
    the padding, filled with large garbage, changes nothing."""
    lengths = [1, 6, 17, 3]
    q, ks, vs = _qkv(len(lengths), lengths, hq, hkv, seed=7)
    width = max(lengths)
    k = torch.full((len(lengths), width, hkv, D), 1e4)
    v = torch.full((len(lengths), width, hkv, D), -1e4)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    for r, n in enumerate(lengths):
        k[r, :n], v[r, :n], valid[r, :n] = ks[r], vs[r], True
    out, lse = padded_attention(q, k, v, valid, D**-0.5)
    for r in range(len(lengths)):
        o, lse_r = partial_attention(q[r : r + 1], ks[r], vs[r], D**-0.5)
        torch.testing.assert_close(out[r : r + 1], o, atol=ATOL, rtol=0)
        torch.testing.assert_close(lse[r : r + 1], lse_r, atol=ATOL, rtol=0)


def test_merge_grouped_equals_merge_per_owner():
    gen = torch.Generator().manual_seed(11)
    owner = torch.tensor([0, 2, 1, 0, 2, 2, 0])  # rows of three owners, interleaved
    out = torch.randn(len(owner), 4, D, generator=gen)
    lse = 3 * torch.randn(len(owner), 4, generator=gen)
    merged = merge_grouped(out, lse, owner, 3)
    for g in range(3):
        rows = (owner == g).nonzero().flatten().tolist()
        want = merge_partials([out[r] for r in rows], [lse[r] for r in rows])
        torch.testing.assert_close(merged[g], want, atol=ATOL, rtol=0)
