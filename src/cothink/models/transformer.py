"""The decoder in plain PyTorch: Llama, Qwen2, Qwen3 and the Qwen3.5 hybrid (Gated DeltaNet, gated attention).
The MoE and Kimi Linear families' parts (sparse MLPs, KDA, MLA) come from models/families.py.

Module and parameter names follow the Hugging Face checkpoints so weights load by name. The model
never touches memory itself: token mixing goes through a `ForwardContext`, which the execution
layer implements over blocks and views. Tokens of all items in a step arrive flattened, [T, hidden].

Every module here is plain torch. The small element-wise pieces (the norms, `SiluMul`, `SigmoidGate`,
`DecayGates`, `DeltaRecurrence`) are modules of their own so that an execution backend can replace
them by module replacement (the native backend's C kernels: execution/native_modules.py), as the
linears are replaced (models/packing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from cothink.models.config import FULL_ATTENTION, GDNConfig, ModelConfig
from cothink.models.moe import SparseMoeBlock
from cothink.models.packing import FastLinear
from cothink.ops.gdn import affine_summary, causal_conv, delta_rule, l2norm


class ForwardContext(Protocol):
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (normed, not rotated) -> attention output [T, Hq, D]."""

    def linear_attention(
        self, layer: int, mixer: GatedDeltaNet, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        """Pre-conv rows [T, conv_dim], g/beta [T, HV] fp32 -> delta-rule output [T, HV, V] fp32."""


# hidden states [T, hidden] after the embedding -> after the last decoder layer
DecoderLayers = Callable[[torch.Tensor, ForwardContext], torch.Tensor]


class VisionInput(Protocol):
    """Image and video placeholders of a step (execution/step.py BatchVision)."""

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] -> the same with the placeholder rows replaced by features."""

    def after_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Decoder layer `layer`'s output -> the same plus its DeepStack features (Qwen3-VL)."""


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

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add and the next norm (one kernel in the
        native backend's module)."""
        total = x + residual
        return self(total), total


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


class SiluMul(nn.Module):
    """silu(gate) * up for rows [gate | up] (the fused gate/up projection's output)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class SigmoidGate(nn.Module):
    """Qwen3.5's attention output gate: out [T, heads * D] times sigmoid(gate [T, heads, D])."""

    def forward(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return out * torch.sigmoid(gate.reshape(out.shape))


class DecayGates(nn.Module):
    """Gated DeltaNet's per-token log decay g and write strength beta, [T, HV] float32, from the
    b and a projections and the layer's A_log and dt_bias (they do not pass through the conv)."""

    def forward(
        self, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        beta = b.sigmoid().float()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        return g, beta


def split_heads(cfg: GDNConfig, post_conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-conv rows [n, conv_dim] -> delta-rule inputs q, k [n, HV, K] and v [n, HV, V], fp32."""
    n = post_conv.shape[0]
    q, k, v = post_conv.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    repeat = cfg.num_v_heads // cfg.num_k_heads  # value head h reads key head h // repeat
    q = l2norm(q.reshape(n, cfg.num_k_heads, cfg.k_dim)).repeat_interleave(repeat, dim=1) * cfg.k_dim**-0.5
    k = l2norm(k.reshape(n, cfg.num_k_heads, cfg.k_dim)).repeat_interleave(repeat, dim=1)
    return q, k, v.reshape(n, cfg.num_v_heads, cfg.v_dim)


class DeltaRecurrence(nn.Module):
    """Gated DeltaNet's token mixing over a few tokens from a state: the causal conv (after
    `history`, the W-1 preceding pre-conv rows) and the gated delta rule. The ForwardContext runs it
    per item (execution/linear_state.py `run_tokens`), from the state of the item's view."""

    def __init__(self, cfg: GDNConfig):
        super().__init__()
        self.cfg = cfg

    def forward(
        self, history: torch.Tensor, rows: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [n, conv_dim] pre-conv, g and beta [n, HV] fp32, state [HV, K, V] fp32 -> (out
        [n, HV, V] fp32, the state after the rows)."""
        q, k, v = split_heads(self.cfg, causal_conv(history, rows, conv_weight))
        return delta_rule(q, k, v, g, beta, state)


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the parts' outputs side by side (one matmul instead of several).

    The fused weight owns the storage; each part's parameters become views of their rows, so the
    Hugging Face names keep working (loading, references, quantization read them) at no extra memory.
    """
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    row = 0
    for p in parts:
        n = p.out_features
        p.weight = nn.Parameter(fused.weight[row : row + n], requires_grad=False)
        if has_bias:
            p.bias = nn.Parameter(fused.bias[row : row + n], requires_grad=False)
        row += n
    return fused


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse()
        self.act = SiluMul()  # of the fused projection's rows

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(self.act(self.gate_up_proj(x)))
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
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Module | None = None  # set by fuse()
        self.qkv_sizes = [q_out, kv_out, kv_out]
        self.output_gate = SigmoidGate() if self.gated else None

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, -1)
        gate = None
        if self.gated:  # per head: first head_dim channels are the query, the next head_dim the gate
            q, gate = q.chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = ctx.attention(self.layer, q, k, v).reshape(t, -1).to(x.dtype)
        if gate is not None:  # applied after the merge of per-block partials: it depends on the query only
            out = self.output_gate(out, gate)
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
        self.in_proj: nn.Module | None = None  # qkv, z, b, a in one matmul; set by fuse()
        self.in_sizes = [g.conv_dim, g.value_dim, g.num_v_heads, g.num_v_heads]
        self.gates = DecayGates()
        self.recurrence = DeltaRecurrence(g)

    def fuse(self) -> None:
        self.in_proj = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]

    def split(self, post_conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv rows [n, conv_dim] -> delta-rule inputs q, k [n, HV, K] and v [n, HV, V], fp32."""
        return split_heads(self.cfg, post_conv)

    @staticmethod
    def affine_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """[B | A] of a run of tokens, g [n, HV] per head (ops/gdn.py)."""
        return affine_summary(k, v, g, beta)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, g = x.shape[0], self.cfg
        if self.in_proj is not None:
            rows, z, b, a = self.in_proj(x).split(self.in_sizes, dim=-1)
            rows = rows.contiguous()  # kept as the block's GDN records
        else:
            rows, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        decay, beta = self.gates(b, a, self.A_log, self.dt_bias)
        core = ctx.linear_attention(self.layer, self, rows, decay, beta)
        z = z.reshape(t, g.num_v_heads, g.v_dim)
        return self.out_proj(self.norm(core.to(x.dtype), z).reshape(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        linear = cfg.layer_types[layer] != FULL_ATTENTION
        # ---- MoE / Kimi Linear families (models/families.py): their mixers and sparse MLPs ----
        mixer, mlp = None, None
        if cfg.family_config is not None:
            from cothink.models.families import family_mixer, family_mlp  # it imports this module

            mixer, mlp = family_mixer(cfg, layer, linear), family_mlp(cfg, layer)
        if mixer is not None:  # Kimi's KDA or MLA
            self.self_attn = mixer
        elif linear:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer)
        self.mlp = mlp if mlp is not None else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: full attention, or Gated DeltaNet (kept under its Hugging Face name)."""
        return self.self_attn if hasattr(self, "self_attn") else self.linear_attn

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        normed, x = self.post_attention_layernorm.add_forward(x, self.mixer(self.input_layernorm(x), ctx))
        return x + self.mlp(normed)


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

    def token_macs(self) -> int:
        """About the multiply-adds of one prefill token through the decoder layers: the elements of
        their weight matrices, a routed MoE's experts at their top_k share (embedding and lm_head,
        which a prefill token does not read in full, left out)."""
        shares = {
            f"{name}.experts.": m.cfg.top_k / m.cfg.num_experts
            for name, m in self.model.layers.named_modules()
            if isinstance(m, SparseMoeBlock)
        }
        total = 0.0
        for key, t in self.model.layers.state_dict().items():
            if t.dim() >= 2:
                total += t.numel() * next((f for p, f in shares.items() if key.startswith(p)), 1.0)
        return int(total)

    def fuse_projections(self) -> None:
        """Concatenate the projections that read the same input (q/k/v, gate/up, the GDN inputs):
        fewer, larger matmuls per layer (the fast path). fp32 results match the unfused modules to
        rounding."""
        for layer in self.model.layers:
            layer.mixer.fuse()
            layer.mlp.fuse()

    @property
    def fused(self) -> bool:
        """Whether the projections are fused (the fast path; False: the eager modules)."""
        return all(getattr(layer.mlp, "gate_up_proj", None) is not None for layer in self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, logit_rows: torch.Tensor,
        layers: DecoderLayers | None = None, vision: VisionInput | None = None,
        to_logits: DecoderLayers | None = None,
    ) -> torch.Tensor:
        """input_ids [T] -> float32 logits for the rows `logit_rows` (distinct ascending indices into
        T). `layers`, if given, runs the decoder layers in place of the modules (a backend that runs
        them in one call: the native backend's fused decode step); `to_logits`, if given, runs them
        and the final norm and lm_head, to every row's logits, where every row wants them. `vision`,
        if given, gives the image placeholders their features (and DeepStack features after the
        first layers)."""
        x = self.model.embed_tokens(input_ids)
        if vision is not None:
            x = vision.embed(x)
        if to_logits is not None and logit_rows.numel() == x.shape[0]:
            return to_logits(x, ctx)
        if layers is not None:
            x = layers(x, ctx)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, ctx)
                if vision is not None:
                    x = vision.after_layer(i, x)
        if logit_rows.numel() == 0:
            return x.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        # every row (decode steps): no gather
        h = self.model.norm(x if logit_rows.numel() == x.shape[0] else x[logit_rows])
        if isinstance(self.lm_head, FastLinear):  # float32 logits in the product's own pass
            return self.lm_head.float_forward(h)
        return self.lm_head(h).float()
