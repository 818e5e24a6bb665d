"""Kimi Delta Attention (KDA) in plain PyTorch: per-channel gates, the delta rule, affine block summaries.

KDA is Gated DeltaNet (ops/gdn.py) with a decay per key channel instead of per head. Per head the
state S is [K, V] and a token acts as
    S <- M_t S + N_t,  M_t = (I - beta_t k_t k_t^T) Diag(exp g_t),  N_t = beta_t k_t v_t^T,  g_t in R^K.
M_t is not symmetric, so the [K, V] left-multiplied layout is kept throughout. A run of tokens is one
affine map S -> A S + B; the packed summary [B | A], `apply_summary` and `compose` are those of
ops/gdn.py unchanged (their algebra does not depend on the form of M_t), and so are the token and
chunked forms, which ops/gdn.py writes for a decay per head or per key channel. Everything recurrent is fp32.
"""

from __future__ import annotations

import torch

from cothink.ops.gdn import apply_summary, compose, gated_delta_rule, gated_summary, recurrent
from cothink.ops.gdn import chunked as gated_chunked

__all__ = [
    "CHUNK",
    "L2NORM_EPS",
    "affine_summary",
    "apply_summary",
    "compose",
    "delta_rule",
    "forget_gate",
    "l2norm",
    "recurrent",
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
    return gated_delta_rule(q, k, v, g, beta, state, CHUNK)


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked (WY) form of `delta_rule` (ops/gdn.py's `chunked` with a per-channel decay)."""
    return gated_chunked(q, k, v, g, beta, state, chunk)


def affine_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The map S -> A S + B of a run of tokens (g [n, H, K]), returned packed as [H, K, V + K] = [B | A]."""
    return gated_summary(k, v, g, beta, CHUNK)
