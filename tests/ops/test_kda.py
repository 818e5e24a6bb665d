"""Kimi Delta Attention: cothink.ops.kda and cothink.models.kda against a float64 token-by-token reference
and transformers' KDA layer; block summaries [B | A] composed across block boundaries (conv heads
recomputed)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from support import tiny_kimi_config

from cothink.errors import UnsupportedModelError
from cothink.models.kda import KimiDeltaAttention, fuse_kda_convs, run_tokens
from cothink.models.moe_config import family_config_from_hf
from cothink.ops.gdn import causal_conv
from cothink.ops.kda import (
    CHUNK,
    affine_summary,
    apply_summary,
    chunked,
    compose,
    delta_rule,
    forget_gate,
    l2norm,
    recurrent,
)

H, K, V = 3, 8, 6

# transformers binds fla / causal_conv1d kernels at import when they are installed: other numerics
_KERNELS = importlib.util.find_spec("fla") or importlib.util.find_spec("causal_conv1d")
needs_torch_reference = pytest.mark.skipif(
    bool(_KERNELS), reason="transformers would dispatch to fla kernels"
)


def _inputs(n: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, H, K, generator=gen, dtype=torch.float64)) * K**-0.5
    k = l2norm(torch.randn(n, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(n, H, V, generator=gen, dtype=torch.float64)
    # per-channel log decays, from almost none to exp(-3) per token
    g = -(torch.rand(n, H, K, generator=gen, dtype=torch.float64) ** 2) * 3
    beta = torch.rand(n, H, generator=gen, dtype=torch.float64)
    state = torch.randn(H, K, V, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, state))


def _reference(q, k, v, g, beta, state):
    """KDA written from its definition, float64, one token at a time:
    S <- (I - beta k k^T) Diag(exp g) S + beta k v^T,  o = S^T q."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    eye = torch.eye(K, dtype=torch.float64)
    outs = []
    for t in range(q.shape[0]):
        m = (eye - beta[t][:, None, None] * k[t][:, :, None] * k[t][:, None, :]) @ torch.diag_embed(
            g[t].exp()
        )
        s = m @ s + beta[t][:, None, None] * k[t][:, :, None] * v[t][:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs), s


@pytest.mark.parametrize("n", [1, 3, 5, CHUNK, CHUNK + 1, 41, 4 * CHUNK, 100])
def test_delta_rule_forms_equal_the_float64_definition(n):
    """Recurrent and chunked forms (across chunk boundaries and partial chunks) equal the definition:
    float64 to 1e-12, fp32 to rounding."""
    args64 = _inputs(n, seed=n, dtype=torch.float64)
    want_out, want_state = _reference(*args64)
    for form in (recurrent, chunked, delta_rule):
        out, state = form(*args64)
        torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(state, want_state, atol=1e-12, rtol=0)
        out32, state32 = form(*(x.float() for x in args64))
        torch.testing.assert_close(out32.double(), want_out, atol=2e-5, rtol=0)
        torch.testing.assert_close(state32.double(), want_state, atol=2e-5, rtol=0)


@needs_torch_reference
@pytest.mark.parametrize("n", [1, 7, 64, 90])
def test_delta_rule_equals_transformers_kda_functions(n):
    """Our forms equal transformers' recurrent_kimi_delta_attention and chunk_kimi_delta_attention (fp32)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    gen = torch.Generator().manual_seed(50 + n)
    q_raw, k_raw = torch.randn(n, H, K, generator=gen), torch.randn(n, H, K, generator=gen)
    _, _, v, g, beta, state = _inputs(n, seed=60 + n)
    q, k = l2norm(q_raw) * K**-0.5, l2norm(k_raw)
    out, new_state = delta_rule(q, k, v, g, beta, state)
    for fn in (kimi.recurrent_kimi_delta_attention, kimi.chunk_kimi_delta_attention):
        ref_out, ref_state = fn(
            q_raw[None],
            k_raw[None],
            v[None],
            g=g[None],
            beta=beta[None],
            initial_state=state[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out, ref_out[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(new_state, ref_state[0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("sizes", [[1, 3, 66, 1, 62, 17], [16, 16, 5], [2, 1, 1, 40]])
def test_summaries_composed_in_any_split_equal_the_whole_run(sizes):
    """[B | A] of each block, composed left to right (and as a tree), applied to a random state, equals the
    recurrence over the concatenation: float64 to 1e-12, fp32 tight."""
    n = sum(sizes)
    _, k, v, g, beta, state = _inputs(n, seed=n, dtype=torch.float64)
    _, want = _reference(k, k, v, g, beta, state)
    cuts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        pieces = [
            affine_summary(*(x[a:b].to(dtype) for x in (k, v, g, beta))) for a, b in zip(cuts, cuts[1:])
        ]
        assert pieces[0].shape == (H, K, V + K)
        left = pieces[0]
        for p in pieces[1:]:
            left = compose(left, p)
        stepwise = state.to(dtype)
        for p in pieces:
            stepwise = apply_summary(p, stepwise)
        tree = compose(compose(pieces[0], pieces[1]), pieces[2]) if len(pieces) == 3 else None
        for got in (apply_summary(left, state.to(dtype)), stepwise):
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
        if tree is not None:  # associativity
            torch.testing.assert_close(
                tree, compose(pieces[0], compose(pieces[1], pieces[2])), atol=tol, rtol=0
            )


def test_summary_a_is_the_product_of_the_token_maps():
    """A of the augmented-value trick equals prod_t (I - beta k k^T) Diag(exp g), explicitly (float64)."""
    n = 9
    _, k, v, g, beta, _ = _inputs(n, seed=3, dtype=torch.float64)
    packed = affine_summary(k, v, g, beta)
    eye = torch.eye(K, dtype=torch.float64)
    a = eye.expand(H, K, K)
    for t in range(n):
        m = (eye - beta[t][:, None, None] * k[t][:, :, None] * k[t][:, None, :]) @ torch.diag_embed(
            g[t].exp()
        )
        a = m @ a
    torch.testing.assert_close(packed[..., V:], a, atol=1e-13, rtol=0)
    _, b = _reference(k, k, v, g, beta, torch.zeros(H, K, V, dtype=torch.float64))
    torch.testing.assert_close(packed[..., :V], b, atol=1e-13, rtol=0)


def test_forget_gate_softplus_matches_transformers_form():
    """g = -exp(A_log) * softplus(a + dt_bias) with the identity above 20, per head and channel."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(5, H * K, generator=gen) * 15
    a_log, dt_bias = torch.randn(1, 1, H, 1, generator=gen), torch.randn(H * K, generator=gen)
    g = forget_gate(a, a_log, dt_bias, K)
    x = (a + dt_bias).view(5, H, K).double()
    soft = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g.double(), -a_log.double().exp().view(H, 1) * soft, atol=1e-5, rtol=1e-6)


# ---- the layer ------------------------------------------------------------------------------------------

HIDDEN = 32


def _layers(seed: int = 0):
    """transformers' KDA layer with every parameter random (mild decays), and ours with its weights."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    hf_cfg = tiny_kimi_config()
    ref = KimiLinearDeltaAttention(hf_cfg, 0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    cfg = family_config_from_hf(hf_cfg).kda
    ours = KimiDeltaAttention(cfg, HIDDEN, 0).eval()
    ours.load_state_dict({k.replace("forget_gate.", ""): v for k, v in ref.state_dict().items()}, strict=True)
    return ours, ref


def _run(ours: KimiDeltaAttention, x: torch.Tensor, cuts: list[int]):
    """Our layer over x [T, hidden] in pieces, carrying the conv tail and the recurrent state."""
    c = ours.cfg
    tail = torch.zeros(c.conv_kernel - 1, c.conv_dim)
    state = torch.zeros(c.num_heads, c.head_dim, c.head_dim)
    outs = []
    for a, b in zip(cuts, cuts[1:]):

        def mix(rows, g, beta, tail=tail):
            nonlocal state
            core, state = run_tokens(ours, tail, rows, g, beta, state)
            return core

        piece = x[a:b]
        outs.append(ours(piece, mix))
        tail = torch.cat((tail, ours.rows(piece)))[-(c.conv_kernel - 1) :]
    return torch.cat(outs), state


@needs_torch_reference
def test_layer_equals_transformers_whole_chunked_and_token_by_token():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention  # noqa: F401

    ours, ref = _layers()
    n = 45
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = ref(x[None])[0]
        for cuts in ([0, n], [0, 7, 8, 21, 23, n], list(range(n + 1))):
            got, _ = _run(ours, x, cuts)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert want.abs().max() > 0.05


def _block_head_body(ours: KimiDeltaAttention, rows, g, beta, tail, state, dense: bool):
    """Advance (state, tail) over one block: its first W-1 tokens recomputed against the predecessor's conv
    tail, the rest from the block's own rows only (a summary [B | A] if `dense`, else replayed)."""
    w = ours.cfg.conv_kernel - 1
    head = min(w, rows.shape[0])
    _, state = run_tokens(ours, tail, rows[:head], g[:head], beta[:head], state)
    if rows.shape[0] > head:
        if dense:
            _, k, v = ours.split(causal_conv(rows[:w], rows[w:], ours.conv_weight))
            state = apply_summary(affine_summary(k, v, g[w:], beta[w:]), state)
        else:
            _, state = run_tokens(ours, rows[:w], rows[w:], g[w:], beta[w:], state)
    return state, torch.cat((tail, rows))[-w:]


@pytest.mark.parametrize("sizes", [[9, 2, 40, 1, 23], [1, 1, 5, 30], [64, 3]])
def test_blocks_with_conv_heads_recomputed_equal_the_whole_run(sizes):
    """Per-block records (pre-conv rows, g, beta) composed in order, each block's first W-1 tokens
    recomputed across the boundary (1-token blocks: the tail spans blocks), equal the layer run over the
    concatenation; next-token outputs from the composed state agree too."""
    ours, _ = _layers(seed=1)
    n = sum(sizes) + 1
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(len(sizes)))
    with torch.no_grad():
        want_out, want_state = _run(ours, x, [0, n - 1, n])
        _, want_before_last = _run(ours, x[:-1], [0, n - 1])
        rows, (g, beta) = ours.rows(x), ours.gates(x)
        cuts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        c = ours.cfg
        for dense in (True, False):
            state = torch.zeros(c.num_heads, c.head_dim, c.head_dim)
            tail = torch.zeros(c.conv_kernel - 1, c.conv_dim)
            for a, b in zip(cuts, cuts[1:]):
                state, tail = _block_head_body(ours, rows[a:b], g[a:b], beta[a:b], tail, state, dense)
            torch.testing.assert_close(state, want_before_last, atol=2e-6, rtol=1e-5)
            core, last_state = run_tokens(ours, tail, rows[-1:], g[-1:], beta[-1:], state)
            torch.testing.assert_close(last_state, want_state, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(ours.output(core, x[-1:]), want_out[-1:], atol=2e-6, rtol=1e-5)


def test_blocks_in_random_orders_equal_the_concatenation_in_that_order():
    """Blocks recorded once (each block's rows depend only on its own inputs) and read in other orders equal
    the layer run over the blocks' inputs concatenated in that order."""
    ours, _ = _layers(seed=2)
    sizes = [9, 2, 40, 1, 23]
    gen = torch.Generator().manual_seed(10)
    blocks = [torch.randn(s, HIDDEN, generator=gen) for s in sizes]
    c = ours.cfg
    with torch.no_grad():
        recs = [(ours.rows(b), *ours.gates(b)) for b in blocks]
        for order in ([0, 1, 2, 3, 4], [2, 0, 4, 1, 3], [3, 2]):
            x = torch.cat([blocks[i] for i in order])
            _, want = _run(ours, x, [0, x.shape[0]])
            state = torch.zeros(c.num_heads, c.head_dim, c.head_dim)
            tail = torch.zeros(c.conv_kernel - 1, c.conv_dim)
            for i in order:
                state, tail = _block_head_body(ours, *recs[i], tail, state, dense=True)
            torch.testing.assert_close(state, want, atol=2e-6, rtol=1e-5)


def test_fuse_kda_convs_and_its_errors():
    ours, ref = _layers(seed=3)
    cfg = ours.cfg
    conv = ref.conv1d.weight.detach()
    state = {f"m.{n}_conv1d.weight": part for n, part in zip("qkv", conv.chunk(3, dim=0))}
    fuse_kda_convs(state, "m", cfg)
    assert list(state) == ["m.conv1d.weight"] and torch.equal(state["m.conv1d.weight"], conv)
    state = {f"m.{n}_conv1d.weight": part for n, part in zip("qk", conv.chunk(3, dim=0))}
    with pytest.raises(UnsupportedModelError, match=r"m\.v_conv1d\.weight is missing"):
        fuse_kda_convs(state, "m", cfg)
    state = {f"m.{n}_conv1d.weight": part[:, :, :-1] for n, part in zip("qkv", conv.chunk(3, dim=0))}
    with pytest.raises(UnsupportedModelError, match=r"m\.q_conv1d\.weight has shape"):
        fuse_kda_convs(state, "m", cfg)


def test_random_splits_of_summaries_float64():
    """Random block sizes (seeded), composed summaries vs the float64 definition, to 1e-12."""
    rng = random.Random(4)
    for trial in range(3):
        sizes = [rng.randint(1, 30) for _ in range(rng.randint(2, 6))]
        n = sum(sizes)
        _, k, v, g, beta, state = _inputs(n, seed=100 + trial, dtype=torch.float64)
        _, want = _reference(k, k, v, g, beta, state)
        got, a = state, 0
        for s in sizes:
            got = apply_summary(
                affine_summary(k[a : a + s], v[a : a + s], g[a : a + s], beta[a : a + s]), got
            )
            a += s
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
