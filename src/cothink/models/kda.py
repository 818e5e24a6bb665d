"""Kimi Linear's KDA token mixer (Kimi Delta Attention) as a module, with the checkpoint's parameter names.

Per token: pre-conv rows [q | k | v] (3*H*K channels) go through a causal depthwise conv (width W, no
bias) and SiLU; q and k are l2-normalised (q scaled by K**-0.5); beta = sigmoid(b_proj x) per head;
g = forget_gate(f_b_proj(f_a_proj x)) per channel; the KDA delta rule (ops/kda.py) gives the core
output, which goes through an RMSNorm over each head in fp32 (weight in fp32), times
sigmoid(g_b_proj(g_a_proj x)), then o_proj.

Names are the checkpoint's (`f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` directly under the mixer), except
the conv: the checkpoint's `q_conv1d`, `k_conv1d`, `v_conv1d` [H*K, 1, W] are held concatenated as
`conv1d` [3*H*K, 1, W] (`fuse_kda_convs`), as the rows are one [q | k | v] tensor. As for Gated DeltaNet,
the module never touches memory: `forward` hands (rows, g, beta) to the caller's `mix`, which owns the
conv history and the recurrent state (a view's blocks, their head tokens and summaries).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cothink.errors import UnsupportedModelError
from cothink.models.moe_config import KdaConfig
from cothink.ops.gdn import causal_conv
from cothink.ops.kda import delta_rule, forget_gate, l2norm

# rows [T, conv_dim], g [T, H, K] fp32, beta [T, H] fp32 -> core output [T, H, V] fp32
KdaMix = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over each head, all in fp32 (the weight too), times sigmoid(gate); cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: KdaConfig, hidden_size: int, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        hk, k = cfg.key_dim, cfg.head_dim
        self.q_proj = nn.Linear(hidden_size, hk, bias=False)
        self.k_proj = nn.Linear(hidden_size, hk, bias=False)
        self.v_proj = nn.Linear(hidden_size, hk, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, k, bias=False)
        self.f_b_proj = nn.Linear(k, hk, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(hk))
        self.A_log = nn.Parameter(torch.zeros(1, 1, cfg.num_heads, 1))
        self.b_proj = nn.Linear(hidden_size, cfg.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, k, bias=False)
        self.g_b_proj = nn.Linear(k, hk, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(k, cfg.norm_eps)
        self.o_proj = nn.Linear(hk, hidden_size, bias=False)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-conv rows [T, 3*H*K] = [q | k | v] projections, in the model dtype."""
        return torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel log decay g [T, H, K] and per-head write strength beta [T, H], fp32 (neither
        passes through the conv)."""
        g = forget_gate(self.f_b_proj(self.f_a_proj(x)), self.A_log, self.dt_bias, self.cfg.head_dim)
        return g, torch.sigmoid(self.b_proj(x)).float()

    def split(self, post_conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv rows [n, 3*H*K] -> delta-rule inputs q, k, v [n, H, K] fp32 (q, k normalised)."""
        c, n = self.cfg, post_conv.shape[0]
        q, k, v = post_conv.float().view(n, 3, c.num_heads, c.head_dim).unbind(1)
        return l2norm(q) * c.head_dim**-0.5, l2norm(k), v

    def output(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Core output [T, H, V] -> o_proj(RMSNorm_fp32(core) * sigmoid(gate)), [T, hidden] in x's dtype."""
        t, c = x.shape[0], self.cfg
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, c.num_heads, c.head_dim)
        # the core output is handed on in the model dtype
        return self.o_proj(self.o_norm(core.to(x.dtype), gate).reshape(t, -1))

    def forward(self, x: torch.Tensor, mix: KdaMix) -> torch.Tensor:
        """x [T, hidden] (the input norm's output) -> [T, hidden]; `mix` runs the conv and delta rule
        over the rows against the state it owns."""
        g, beta = self.gates(x)
        return self.output(mix(self.rows(x), g, beta), x)


def run_tokens(
    mixer: KimiDeltaAttention,
    history: torch.Tensor,
    rows: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv (after `history`, the W-1 preceding pre-conv rows) and delta rule over rows; (out, state)."""
    q, k, v = mixer.split(causal_conv(history, rows, mixer.conv_weight))
    return delta_rule(q, k, v, g, beta, state)


def fuse_kda_convs(state: dict[str, torch.Tensor], prefix: str, cfg: KdaConfig) -> None:
    """Replace `<prefix>.{q,k,v}_conv1d.weight` [H*K, 1, W] in `state` by `<prefix>.conv1d.weight`
    [3*H*K, 1, W], in place; UnsupportedModelError names a missing or misshapen tensor."""
    shape = (cfg.key_dim, 1, cfg.conv_kernel)
    parts = []
    for name in ("q", "k", "v"):
        key = f"{prefix}.{name}_conv1d.weight"
        tensor = state.get(key)
        if tensor is None:
            raise UnsupportedModelError(f"KDA tensor {key} is missing")
        if tuple(tensor.shape) != shape:
            raise UnsupportedModelError(f"KDA tensor {key} has shape {tuple(tensor.shape)}, expected {shape}")
        parts.append(tensor)
    for name in ("q", "k", "v"):
        del state[f"{prefix}.{name}_conv1d.weight"]
    state[f"{prefix}.conv1d.weight"] = torch.cat(parts, dim=0)
