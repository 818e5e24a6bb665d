"""Gated DeltaNet math in plain PyTorch: the short conv, the delta rule, and affine block summaries.

Layout follows transformers/fla: per value head the state S is [K, V] and a token acts as
    S <- M_t S + N_t,  M_t = alpha_t (I - beta_t k_t k_t^T),  N_t = beta_t k_t v_t^T.
A run of tokens is one affine map S -> A S + B; maps compose as (A2 A1, A2 B1 + B2)
(docs/architecture.md, "Memory choices for Gated DeltaNet blocks").
Everything recurrent is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2NORM_EPS = 1e-6  # of the l2 normalisation of q and k (as transformers' Qwen3.5)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# up to this many rows (decode steps), the conv is W multiply-adds per row, done elementwise: a
# oneDNN convolution call costs ~1 ms of setup per layer for a single row on CPU
SMALL_CONV_ROWS = 8


def causal_conv(history: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of rows [n, C], preceded by history [W-1, C]; weight [C, W]."""
    x = torch.cat((history, rows), dim=0).to(weight.dtype)  # [W-1+n, C]
    if rows.shape[0] <= SMALL_CONV_ROWS:
        out = (x.unfold(0, weight.shape[1], 1) * weight).sum(-1)  # [n, C, W] windows -> [n, C]
        return F.silu(out).to(rows.dtype)
    out = F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])  # [1, C, n]
    return F.silu(out)[0].t().to(rows.dtype)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gated delta rule over n tokens from `state`.

    q, k: [n, H, K] fp32, already l2-normalised (q also scaled by K**-0.5) and expanded to value heads;
    v: [n, H, V]; g (log decay), beta: [n, H]; state: [H, K, V]. Returns (out [n, H, V], new state).
    Short runs use the token recurrence, longer ones the chunked (WY) form; both are exact.
    """
    if q.shape[0] <= 4:
        return _recurrent(q, k, v, g, beta, state)
    return _chunked(q, k, v, g, beta, state)


def _recurrent(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def _by_chunk(x: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """[n, H, *] (n padded to n_chunks * CHUNK) -> [H, n_chunks, CHUNK, *]."""
    return x.reshape(n_chunks, CHUNK, *x.shape[1:]).movedim(2, 0)


def _chunked(q, k, v, g, beta, state):
    # Chunks of CHUNK tokens, heads first: [H, N, C, *]. What a chunk computes from its own tokens
    # (the WY system and its solves, the decays, the intra-chunk scores) is done for all chunks at
    # once; only the state's pass from chunk to chunk loops. The last chunk is padded with tokens of
    # zero k, beta and log decay: they leave the state as it is, and their outputs are dropped.
    n = q.shape[0]
    n_chunks = -(-n // CHUNK)
    pad = n_chunks * CHUNK - n
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    q, k, v = (_by_chunk(x, n_chunks) for x in (q, k, v))
    g, beta = (_by_chunk(x, n_chunks) for x in (g, beta))  # [H, N, C]
    cum = g.cumsum(dim=-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit diagonal is implied by solve_triangular below
    system = system.tril(-1) + torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    gain = cum.exp()[..., None]  # exp(G_i): token i's decay since the chunk's start
    w = torch.linalg.solve_triangular(system, k_beta * gain, upper=False, unitriangular=True)
    q_decayed = q * gain
    scores = (q @ k.transpose(-1, -2)) * decay
    k_tail = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # [H, N, K, C]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    outs = []
    for c in range(n_chunks):
        v_new = u[:, c] - w[:, c] @ state  # [H, C, V]
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ v_new)
        state = state * chunk_decay[:, c] + k_tail[:, c] @ v_new
    out = torch.stack(outs, dim=1).reshape(q.shape[0], n_chunks * CHUNK, -1)  # [H, N * C, V]
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


def apply_summary(packed: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Apply a packed summary [B | A] to a state [H, K, V]: A S + B."""
    vd = state.shape[-1]
    return packed[..., vd:] @ state + packed[..., :vd]


def compose(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Packed summary of `first` followed by `second`: [A2 B1 + B2 | A2 A1]."""
    kd = first.shape[-2]
    vd = first.shape[-1] - kd
    a2 = second[..., vd:]
    return torch.cat((a2 @ first[..., :vd] + second[..., :vd], a2 @ first[..., vd:]), dim=-1)
