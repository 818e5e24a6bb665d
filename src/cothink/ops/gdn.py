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
    return gated_delta_rule(q, k, v, g[..., None], beta, state, CHUNK)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule for a log decay g of shape [n, H, 1] (one per head, Gated DeltaNet) or [n, H, K]
    (one per key channel, KDA); the other arguments and the result are those of `delta_rule`.
    Runs of up to 4 tokens use `recurrent`, longer ones `chunked` with chunks of `chunk` tokens."""
    if q.shape[0] <= 4:
        return recurrent(q, k, v, g, beta, state)
    return chunked(q, k, v, g, beta, state, chunk)


def recurrent(q, k, v, g, beta, state):
    """The token-by-token form of `gated_delta_rule` (g [n, H, 1] or [n, H, K])."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, :, None]  # Diag(exp g) scales the K rows
        kv_mem = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def _by_chunk(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """[n, H, *] (n padded to n_chunks * chunk) -> [H, n_chunks, chunk, *]."""
    return x.reshape(n_chunks, chunk, *x.shape[1:]).movedim(2, 0)


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, k_beta: torch.Tensor, cum: torch.Tensor, causal: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The strictly lower WY system (beta_i k_i . k_j) exp(G_i - G_j) and the scores (q_i . k_j)
    exp(G_i - G_j), j <= i, [H, N, C, C] each, for a per-head (cum [H, N, C, 1]) or per-key-channel
    (cum [H, N, C, K]) cumulative log decay. The per-head decay factors out of the dot products; the
    per-channel one goes inside them as an [H, N, C, C, K] tensor."""
    if cum.shape[-1] == 1:
        per_head = cum[..., 0]
        decay = (per_head[..., :, None] - per_head[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        return (k_beta @ k.transpose(-1, -2)) * decay, (q @ k.transpose(-1, -2)) * decay
    # masked before exp: above the diagonal it would grow
    diff = (cum[:, :, :, None, :] - cum[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    decay = diff.exp()  # [H, N, C, C, K]
    system = torch.einsum("hnik,hnjk,hnijk->hnij", k_beta, k, decay)
    return system, torch.einsum("hnik,hnjk,hnijk->hnij", q, k, decay)


def chunked(q, k, v, g, beta, state, chunk: int):
    """The chunked (WY) form of `gated_delta_rule` (g [n, H, 1] or [n, H, K]).

    Per chunk, with G_i = g_1 + ... + g_i (restarting each chunk; exp(G_i - G_j) per key channel):
        L_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)  (i > j),  T = (I + L)^-1
        W = T (beta k exp G),  U = T (beta v),  v_new = U - W S
        out_i = (q_i exp G_i) S + sum_{j<=i} (sum_c q_ic k_jc exp(G_ic - G_jc)) v_new_j
        S' = Diag(exp G_n) S + (k exp(G_n - G))^T v_new
    Heads first: [H, N, C, *]. What a chunk computes from its own tokens (the WY system and its solves,
    the decays, the intra-chunk scores) is done for all chunks at once; only the state's pass from
    chunk to chunk loops. The last chunk is padded with tokens of zero k, beta and log decay: they
    leave the state as it is, and their outputs are dropped.
    """
    n = q.shape[0]
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    q, k, v, g = (_by_chunk(x, n_chunks, chunk) for x in (q, k, v, g))  # [H, N, C, *]
    beta = _by_chunk(beta, n_chunks, chunk)  # [H, N, C]
    cum = g.cumsum(dim=2)  # [H, N, C, 1 or K]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta[..., None]
    system, scores = _intra_chunk(q, k, k_beta, cum, causal)  # scores are zero above the diagonal
    system = system.tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    gain = cum.exp()  # exp(G_i): token i's decay since the chunk's start
    w = torch.linalg.solve_triangular(system, k_beta * gain, upper=False, unitriangular=True)
    q_decayed = q * gain
    k_tail = (k * (cum[:, :, -1:] - cum).exp()).transpose(-1, -2)  # [H, N, K, C]
    chunk_decay = cum[:, :, -1].exp()[..., None]  # [H, N, 1 or K, 1]
    outs = []
    for c in range(n_chunks):
        v_new = u[:, c] - w[:, c] @ state  # [H, C, V]
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ v_new)
        state = state * chunk_decay[:, c] + k_tail[:, c] @ v_new
    out = torch.stack(outs, dim=1).reshape(q.shape[0], n_chunks * chunk, -1)  # [H, N * C, V]
    return out.transpose(0, 1)[:n], state


def affine_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The map S -> A S + B of a run of tokens (g, beta [n, H]), packed as [H, K, V + K] = [B | A]."""
    return gated_summary(k, v, g[..., None], beta, CHUNK)


def gated_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int
) -> torch.Tensor:
    """`affine_summary` for a log decay g [n, H, 1] or [n, H, K] (as `gated_delta_rule`).

    Augmented-value trick: the recurrence acts on each column of S independently, so running it with
    values [v | 0] from the state [0 | I] yields [B | A] exactly.
    """
    n, h, kd = k.shape
    aug_v = torch.cat((v, v.new_zeros(n, h, kd)), dim=-1)
    start = torch.cat(
        (v.new_zeros(h, kd, v.shape[-1]), torch.eye(kd, dtype=v.dtype, device=v.device).expand(h, kd, kd)),
        dim=-1,
    )
    _, packed = gated_delta_rule(k, k, aug_v, g, beta, start, chunk)  # the query is irrelevant; reuse k
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
