"""The decoder-layer parts of the MoE and Kimi Linear families (run by models/transformer.py).

A layer of these families is the pre-norm decoder layer of models/transformer.py with other parts:
- the MLP: a sparse MoE block (models/moe.py) where `FamilyConfig.sparse_layers` says so, else the dense
  MLP (`dense_intermediate_size`; Qwen3-Next's `mlp_only_layers`, Kimi's first dense layers);
- Kimi's token mixers, both under the checkpoint's name `self_attn`: KDA (models/kda.py) in its linear
  layers, MLA (models/mla.py) in its attention layers. Qwen3.5-MoE and Qwen3-Next keep Qwen3.5's
  gated attention and Gated DeltaNet unchanged.

Both Kimi mixers go through the ForwardContext as the other mixers do: KDA hands its rows, per-channel
decays and betas to `linear_attention` (the view's blocks, head recompute, summaries and sealing are
those of Gated DeltaNet: execution/linear_state.py, with KDA's `recurrence` and `affine_summary`); MLA
hands its absorbed queries and its latent, as one key/value head, to `attention` (K = V = the latent;
the pool holds it once, and nothing is rotated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cothink.models.kda import KimiDeltaAttention
from cothink.models.mla import MultiLatentAttention
from cothink.models.moe import SparseMoeBlock, split_experts
from cothink.models.moe_config import KdaConfig
from cothink.ops.gdn import SMALL_CONV_ROWS, causal_conv
from cothink.ops.kda import affine_summary, delta_rule, l2norm

if TYPE_CHECKING:
    from cothink.models.config import ModelConfig
    from cothink.models.transformer import ForwardContext


def kda_conv(history: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of rows [n, C] after history [W-1, C] (weight [C, W]), rounded as
    transformers' F.conv1d rounds it in every dtype: products summed in fp32, one rounding to the
    weight dtype, then SiLU. Few rows (decode) take the W products elementwise (no conv call setup)."""
    if rows.shape[0] > SMALL_CONV_ROWS:
        return causal_conv(history, rows, weight)
    x = torch.cat((history, rows), dim=0).to(weight.dtype)
    out = (x.float().unfold(0, weight.shape[1], 1) * weight.float()).sum(-1).to(weight.dtype)
    return F.silu(out).to(rows.dtype)


def split_kda(cfg: KdaConfig, post_conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-conv rows [n, 3*H*K] -> delta-rule inputs q, k, v [n, H, K] fp32 (q, k l2-normalised, q
    scaled by K**-0.5)."""
    n = post_conv.shape[0]
    q, k, v = post_conv.float().view(n, 3, cfg.num_heads, cfg.head_dim).unbind(1)
    return l2norm(q) * cfg.head_dim**-0.5, l2norm(k), v


class KdaRecurrence(nn.Module):
    """KDA's token mixing over a few tokens from a state: the causal conv after `history` (the W-1
    preceding pre-conv rows) and the KDA delta rule (the counterpart of transformer.DeltaRecurrence)."""

    def __init__(self, cfg: KdaConfig):
        super().__init__()
        self.cfg = cfg

    def forward(
        self, history: torch.Tensor, rows: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [n, 3HK] pre-conv, g [n, H, K] and beta [n, H] fp32, state [H, K, K] fp32 -> (out
        [n, H, K] fp32, the state after the rows)."""
        q, k, v = split_kda(self.cfg, kda_conv(history, rows, conv_weight))
        return delta_rule(q, k, v, g, beta, state)


class KdaMixer(KimiDeltaAttention):
    """KDA as a decoder layer's token mixer: its state lives in the view (ForwardContext)."""

    def __init__(self, cfg: KdaConfig, hidden_size: int, layer: int):
        super().__init__(cfg, hidden_size, layer)
        self.recurrence = KdaRecurrence(cfg)
        self.qkv_proj: nn.Module | None = None  # q, k, v in one matmul; set by fuse()

    def fuse(self) -> None:
        """The q, k, v projections in one matmul (the fast path; the HF-named parts view its rows)."""
        from cothink.models.transformer import fuse_linears  # it imports this module

        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return super().rows(x)

    def split(self, post_conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_kda(self.cfg, post_conv)

    @staticmethod
    def affine_summary(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """[B | A] of a run of tokens, g [n, H, K] per key channel (ops/kda.py)."""
        return affine_summary(k, v, g, beta)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # type: ignore[override]
        g, beta = self.gates(x)
        return self.output(ctx.linear_attention(self.layer, self, self.rows(x), g, beta), x)


class MlaMixer(MultiLatentAttention):
    """MLA as a decoder layer's token mixer: the latent is the layer's one key/value head in the pool."""

    def fuse(self) -> None:
        """Nothing to fuse (the fast path replaces its linears only)."""

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # type: ignore[override]
        lat = self.latent(x)[:, None]  # [T, 1, r + dr]: K and V
        return self.output(ctx.attention(self.layer, self.queries(x), lat, lat), x)


class MoeMLP(SparseMoeBlock):
    """The sparse MoE block as a decoder layer's MLP."""

    def fuse(self) -> None:
        """The fast path's experts: one linear pair per expert (models/moe.py `ExpertLinears`, views of
        the stacked weights), which the fast path's linear replacement gives each dtype's kernel, as it
        does the shared expert's linears."""
        split_experts(self)


def family_mixer(cfg: ModelConfig, layer: int, linear: bool) -> KdaMixer | MlaMixer | None:
    """Kimi's mixer of `layer` (held as `self_attn`, the checkpoint's name for both), or None where
    the layer keeps Qwen3.5's."""
    fam = cfg.family_config
    assert fam is not None
    if linear and fam.kda is not None:
        return KdaMixer(fam.kda, cfg.hidden_size, layer)
    if not linear and fam.mla is not None:
        return MlaMixer(fam.mla, cfg.hidden_size, layer)
    return None


def family_mlp(cfg: ModelConfig, layer: int) -> MoeMLP | None:
    """The sparse MoE block of `layer`, or None where the layer's MLP is dense."""
    fam = cfg.family_config
    assert fam is not None
    return MoeMLP(fam.moe) if fam.sparse_layers[layer] else None
