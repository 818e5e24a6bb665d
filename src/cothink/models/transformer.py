"""The decoder in plain PyTorch: Llama, Qwen3 and the Qwen3.5 hybrid (Gated DeltaNet + gated attention).

Module and parameter names follow the Hugging Face checkpoints so weights load by name. The model
never touches memory itself: token mixing goes through a `ForwardContext`, which the execution
layer implements over blocks and views. Tokens of all items in a step arrive flattened, [T, hidden].
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from cothink.models.config import FULL_ATTENTION, ModelConfig
from cothink.ops.gdn import l2norm


class ForwardContext(Protocol):
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (normed, not rotated) -> attention output [T, Hq, D]."""

    def linear_attention(
        self, layer: int, mixer: GatedDeltaNet, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        """Pre-conv rows [T, conv_dim], g/beta [T, HV] fp32 -> delta-rule output [T, HV, V] fp32."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:  # Qwen3.5 scales in fp32, then casts
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)  # Llama/Qwen3 cast first, then scale


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then multiplied by silu(z) (inside Gated DeltaNet)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.gated = cfg.attn_output_gate
        q_out = cfg.num_heads * cfg.head_dim * (2 if self.gated else 1)
        kv_out = cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, -1)
        gate = None
        if self.gated:  # per head: first head_dim channels are the query, the next head_dim the gate
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(t, -1)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = ctx.attention(self.layer, q, k, v).reshape(t, -1).to(x.dtype)
        if gate is not None:  # applied after the merge of per-block partials: it depends on the query only
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        g = cfg.gdn
        assert g is not None
        self.layer, self.cfg = layer, g
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, g.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, g.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, g.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, g.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(g.conv_dim, g.conv_dim, g.conv_kernel, groups=g.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(g.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(g.num_v_heads))
        self.norm = GatedRMSNorm(g.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(g.value_dim, cfg.hidden_size, bias=False)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]

    def split(self, post_conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv rows [n, conv_dim] -> delta-rule inputs q, k [n, HV, K] and v [n, HV, V], fp32."""
        g, n = self.cfg, post_conv.shape[0]
        q, k, v = post_conv.float().split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        repeat = g.num_v_heads // g.num_k_heads  # value head h reads key head h // repeat
        q = l2norm(q.reshape(n, g.num_k_heads, g.k_dim)).repeat_interleave(repeat, dim=1) * g.k_dim**-0.5
        k = l2norm(k.reshape(n, g.num_k_heads, g.k_dim)).repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(n, g.num_v_heads, g.v_dim)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log decay g and write strength beta, [T, HV] fp32 (they do not pass through the conv)."""
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return g, beta

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, g = x.shape[0], self.cfg
        decay, beta = self.gates(x)
        core = ctx.linear_attention(self.layer, self, self.in_proj_qkv(x), decay, beta)
        z = self.in_proj_z(x).view(t, g.num_v_heads, g.v_dim)
        return self.out_proj(self.norm(core.to(x.dtype), z).reshape(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        if cfg.layer_types[layer] == FULL_ATTENTION:
            self.self_attn = Attention(cfg, layer)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixer = self.self_attn if hasattr(self, "self_attn") else self.linear_attn
        x = x + mixer(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> float32 logits for the rows `logit_rows` (indices into T)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, ctx)
        if logit_rows.numel() == 0:
            return x.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        return self.lm_head(self.model.norm(x[logit_rows])).float()
