"""Kimi Delta Attention (KDA) in plain PyTorch: per-channel gates, the delta rule, affine block summaries.

KDA is Gated DeltaNet (ops/gdn.py) with a decay per key channel instead of per head. Per head the
state S is [K, V] and a token acts as
    S <- M_t S + N_t,  M_t = (I - beta_t k_t k_t^T) Diag(exp g_t),  N_t = beta_t k_t v_t^T,  g_t in R^K.
M_t is not symmetric, so the [K, V] left-multiplied layout is kept throughout. A run of tokens is one
affine map S -> A S + B; the packed summary [B | A], `apply_summary` and `compose` are those of
ops/gdn.py unchanged (their algebra does not depend on the form of M_t). Everything recurrent is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cothink.ops.gdn import apply_summary, compose

__all__ = [
    "CHUNK",
    "L2NORM_EPS",
    "affine_summary",
    "apply_summary",
    "compose",
    "delta_rule",
    "forget_gate",
    "l2norm",
]

# Tokens per chunk of the chunked form. Its cost is dominated by the [H, N, C, C, K] decay tensor
# (per-channel exp(G_i - G_j)), so KDA chunks are shorter than Gated DeltaNet's.
CHUNK = 16
L2NORM_EPS = 1e-6  # of the l2 normalisation of q and k
SOFTPLUS_LINEAR_ABOVE = 20.0  # the forget gate's softplus is the identity above this (as transformers)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim: Kimi's form (sqrt and divide, not rsqrt)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def forget_gate(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per-channel log decay g [T, H, K] fp32 from the low-rank gate projection a = f_b(f_a(x)) [T, H*K].

    g = -exp(A_log[h]) * softplus(a + dt_bias), with softplus log(1 + exp(x)) below 20 and x above
    (transformers' form, which differs from F.softplus far below zero)."""
    x = (a.float() + dt_bias.float()).view(a.shape[0], -1, head_dim)
    soft = torch.where(x > SOFTPLUS_LINEAR_ABOVE, x, torch.log(1.0 + torch.exp(x)))
    return -torch.exp(a_log.float().reshape(-1, 1)) * soft


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the KDA delta rule over n tokens from `state`.

    q, k: [n, H, K] fp32, already l2-normalised (q also scaled by K**-0.5); v: [n, H, V];
    g (per-channel log decay): [n, H, K]; beta: [n, H]; state: [H, K, V]. Returns (out [n, H, V],
    new state). Short runs use the token recurrence, longer ones the chunked (WY) form; both are exact.
    """
    if q.shape[0] <= 4:
        return recurrent(q, k, v, g, beta, state)
    return chunked(q, k, v, g, beta, state)


def recurrent(q, k, v, g, beta, state):
    """The token-by-token form of `delta_rule`."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, :, None]  # Diag(exp g) scales the K rows
        recalled = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - recalled) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def _by_chunk(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """[n, H, *] (n padded to n_chunks * chunk) -> [H, n_chunks, chunk, *]."""
    return x.reshape(n_chunks, chunk, *x.shape[1:]).movedim(2, 0)


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked (WY) form of `delta_rule`.

    Per chunk, with G_i = g_1 + ... + g_i in R^K (restarting each chunk):
        L_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)  (i > j),  T = (I + L)^-1
        W = T (beta k exp G),  U = T (beta v),  v_new = U - W S
        out_i = (q_i exp G_i) S + sum_{j<=i} (sum_c q_ic k_jc exp(G_ic - G_jc)) v_new_j
        S' = Diag(exp G_n) S + (k exp(G_n - G))^T v_new
    What a chunk computes from its own tokens is done for all chunks at once; only the state's pass
    from chunk to chunk loops. The last chunk is padded with tokens of zero k, beta and log decay.
    """
    n = q.shape[0]
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    q, k, v, g = (_by_chunk(x, n_chunks, chunk) for x in (q, k, v, g))  # [H, N, C, *]
    beta = _by_chunk(beta, n_chunks, chunk)  # [H, N, C]
    cum = g.cumsum(dim=2)  # [H, N, C, K]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) per channel for j <= i (masked before exp: above the diagonal it would grow)
    diff = (cum[:, :, :, None, :] - cum[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    decay = diff.exp()  # [H, N, C, C, K]
    k_beta = k * beta[..., None]
    system = torch.einsum("hnik,hnjk,hnijk->hnij", k_beta, k, decay)
    system = system.tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    gain = cum.exp()  # exp(G_i)
    w = torch.linalg.solve_triangular(system, k_beta * gain, upper=False, unitriangular=True)
    q_decayed = q * gain
    scores = torch.einsum("hnik,hnjk,hnijk->hnij", q, k, decay)  # zero above the diagonal
    k_tail = (k * (cum[:, :, -1:] - cum).exp()).transpose(-1, -2)  # [H, N, K, C]
    chunk_decay = cum[:, :, -1].exp()[..., None]  # [H, N, K, 1]
    outs = []
    for c in range(n_chunks):
        v_new = u[:, c] - w[:, c] @ state  # [H, C, V]
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ v_new)
        state = state * chunk_decay[:, c] + k_tail[:, c] @ v_new
    out = torch.stack(outs, dim=1).reshape(q.shape[0], n_chunks * chunk, -1)  # [H, N * C, V]
    return out.transpose(0, 1)[:n], state


def affine_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The map S -> A S + B of a run of tokens, returned packed as [H, K, V + K] = [B | A].

    Augmented-value trick: the recurrence acts on each column of S independently, so running it with
    values [v | 0] from the state [0 | I] yields [B | A] exactly.
    """
    n, h, kd = k.shape
    aug_v = torch.cat((v, v.new_zeros(n, h, kd)), dim=-1)
    start = torch.cat(
        (v.new_zeros(h, kd, v.shape[-1]), torch.eye(kd, dtype=v.dtype, device=v.device).expand(h, kd, kd)),
        dim=-1,
    )
    _, packed = delta_rule(k, k, aug_v, g, beta, start)  # the query is irrelevant; reuse k
    return packed
