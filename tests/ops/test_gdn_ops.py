"""cothink.ops.gdn on random tensors: chunked vs recurrent delta rule, affine summaries, the causal conv."""

from __future__ import annotations

import pytest
import torch

from cothink.ops.gdn import (
    CHUNK,
    SMALL_CONV_ROWS,
    affine_summary,
    apply_summary,
    causal_conv,
    compose,
    delta_rule,
    l2norm,
)

H, K, V = 3, 8, 5


def _inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, H, K, generator=gen)) * K**-0.5
    k = l2norm(torch.randn(n, H, K, generator=gen))
    v = torch.randn(n, H, V, generator=gen)
    g = -torch.empty(n, H).uniform_(0.01, 0.5, generator=gen)  # log decays
    beta = torch.rand(n, H, generator=gen)
    state = torch.randn(H, K, V, generator=gen)
    return q, k, v, g, beta, state


def _recurrence(q, k, v, g, beta, state):
    """The gated delta rule one token at a time in float64: S <- a S + k (beta (v - k^T a S))^T."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    outs = []
    for t in range(q.shape[0]):
        s = torch.exp(g[t])[:, None, None] * s
        recalled = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + k[t][:, :, None] * (beta[t][:, None] * (v[t] - recalled))[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs), s


@pytest.mark.parametrize("n", [1, 3, 5, 17, CHUNK, CHUNK + 1, 100, 2 * CHUNK, 2 * CHUNK + 37])
def test_delta_rule_chunked_equals_recurrent(n):
    """delta_rule takes the chunked (WY) form for n > 4, across chunk boundaries and partial chunks."""
    q, k, v, g, beta, state = _inputs(n, seed=n)
    out, new_state = delta_rule(q, k, v, g, beta, state)
    want_out, want_state = _recurrence(q, k, v, g, beta, state)
    assert out.shape == (n, H, V) and new_state.shape == (H, K, V)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(new_state.double(), want_state, atol=2e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 40, CHUNK + 9])
def test_apply_summary_equals_replay(n):
    """A run's packed summary [B | A] applied to any state is the state the run's replay reaches."""
    _, k, v, g, beta, state = _inputs(n, seed=100 + n)
    packed = affine_summary(k, v, g, beta)
    assert packed.shape == (H, K, V + K)
    for s in (state, torch.zeros_like(state), 3 * state):
        _, replayed = delta_rule(k, k, v, g, beta, s)
        torch.testing.assert_close(apply_summary(packed, s), replayed, atol=2e-5, rtol=0)


@pytest.mark.parametrize("split", [1, 10, CHUNK + 3])
def test_compose_equals_sequential_application(split):
    """compose(first, second) applied once == first then second == the summary of the joined run."""
    n = split + 23
    _, k, v, g, beta, state = _inputs(n, seed=200 + split)
    first = affine_summary(k[:split], v[:split], g[:split], beta[:split])
    second = affine_summary(k[split:], v[split:], g[split:], beta[split:])
    both = compose(first, second)
    sequential = apply_summary(second, apply_summary(first, state))
    torch.testing.assert_close(apply_summary(both, state), sequential, atol=2e-5, rtol=0)
    torch.testing.assert_close(both, affine_summary(k, v, g, beta), atol=2e-5, rtol=0)
    # composition is associative: (a b) c == a (b c)
    third = affine_summary(k[:5], v[:5], g[:5], beta[:5])
    torch.testing.assert_close(compose(compose(first, second), third), compose(first, compose(second, third)),
                               atol=2e-5, rtol=0)


def test_causal_conv_after_history_equals_conv_over_the_whole():
    """Conv over rows split anywhere, each part preceded by the previous W-1 rows, equals one conv."""
    gen = torch.Generator().manual_seed(5)
    c, w, n = 6, 4, 19
    weight = torch.randn(c, w, generator=gen)
    rows = torch.randn(n, c, generator=gen)
    zero = torch.zeros(w - 1, c)
    whole = causal_conv(zero, rows, weight)
    padded = torch.cat((zero, rows))
    want = torch.nn.functional.silu(torch.stack([(padded[t : t + w] * weight.t()).sum(0) for t in range(n)]))
    torch.testing.assert_close(whole, want, atol=1e-6, rtol=0)
    for cut in (1, 3, 11):
        history = torch.cat((zero, rows))[cut : cut + w - 1]  # the W-1 rows before `cut`
        torch.testing.assert_close(causal_conv(history, rows[cut:], weight), whole[cut:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", [1, 3, SMALL_CONV_ROWS, SMALL_CONV_ROWS + 1, 40])
def test_causal_conv_matches_a_plain_convolution_at_every_length(n):
    """The elementwise path (decode-sized inputs) and the conv1d path agree with the definition."""
    gen = torch.Generator().manual_seed(n)
    history, rows, weight = (torch.randn(*s, generator=gen) for s in ((3, 24), (n, 24), (24, 4)))
    x = torch.cat((history, rows))
    expect = torch.stack([(x[t : t + 4] * weight.t()).sum(0) for t in range(n)])
    torch.testing.assert_close(causal_conv(history, rows, weight), torch.nn.functional.silu(expect))
