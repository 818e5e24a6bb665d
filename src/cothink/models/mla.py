"""Kimi Linear's attention: multi-head latent attention (MLA) without RoPE, run as latent MQA.

Per token the layer keeps one latent row (what a pool stores, `MlaConfig.latent_dim` values):
    lat = [c | kR],  c = kv_a_layernorm((kv_a_proj_with_mqa x)[:r]),  kR = (kv_a_proj_with_mqa x)[r:]
Head h's key is [W_UK^h c | kR] and its value W_UV^h c (kv_b_proj per head = [W_UK^h (dn x r); W_UV^h
(dv x r)]). Nothing is rotated (Kimi's MLA is NoPE: logits do not depend on positions), so a block's
latents are valid at any offset. Absorbing W_UK into the query,
    q'_h = [W_UK^h^T qN_h | qR_h]  (width r + dr),   score = q'_h . lat_s * (dn + dr)**-0.5,
makes attention one key/value head shared by all query heads with K = V = lat; of its output only the
first r columns are used, mapped by W_UV^h, then o_proj. This runs through cothink.ops.attention's
partial_attention per key run and merge_partials across runs, like any other attention layer.
The absorbed query is computed in fp32 and cast to the latents' dtype for the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cothink.models.moe_config import MLA_LATENT_NORM_EPS, MlaConfig
from cothink.models.transformer import RMSNorm
from cothink.ops.attention import partial_attention

# absorbed queries [T, H, r + dr] and the step's own latents [T, r + dr] -> attention output [T, H, r + dr]
LatentAttend = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class UpProjection(nn.Module):
    """kv_b_proj's weight [H * (dn + dv), r], never applied as a linear: its per-head blocks W_UK and
    W_UV are absorbed into the query and the output (not an nn.Linear, so no fast-path replacement
    of linears repacks it)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MultiLatentAttention(nn.Module):
    """Parameters under the checkpoint's names: q_proj (or q_a_proj, q_a_layernorm, q_b_proj),
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, cfg: MlaConfig, hidden_size: int, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, r = cfg.num_heads, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, cfg.latent_dim, bias=cfg.bias)
        self.kv_a_layernorm = RMSNorm(r, MLA_LATENT_NORM_EPS)
        self.kv_b_proj = UpProjection(r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = nn.Linear(h * cfg.v_head_dim, hidden_size, bias=cfg.bias)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the per-token latent [T, r + dr] = [normed c | kR], in x's dtype."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1
        )
        return torch.cat((self.kv_a_layernorm(c), k_rope), dim=-1)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, r] and W_UV [H, dv, r] (views of kv_b_proj's weight)."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> absorbed queries [T, H, r + dr] in x's dtype."""
        c, t = self.cfg, x.shape[0]
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, c.num_heads, -1).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w_uk, _ = self._up_projections()
        absorbed = torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float())
        return torch.cat((absorbed, q_rope.float()), dim=-1).to(x.dtype)

    def output(self, attended: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention output over latents [T, H, r + dr] (fp32) -> o_proj(W_UV c-part per head) [T, hidden]."""
        _, w_uv = self._up_projections()
        o = torch.einsum("thr,hvr->thv", attended[..., : self.cfg.kv_lora_rank].float(), w_uv.float())
        return self.o_proj(o.reshape(x.shape[0], -1).to(x.dtype))

    def forward(self, x: torch.Tensor, attend: LatentAttend) -> torch.Tensor:
        """x [T, hidden] (the input norm's output) -> [T, hidden]; `attend` runs the queries over the view's
        latents and the step's own (`latent(x)`, which the caller stores)."""
        return self.output(attend(self.queries(x), self.latent(x)), x)


def causal_attend(scale: float) -> LatentAttend:
    """Attend over the step's own latents only, causally (a sequence from its start)."""

    def attend(q: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
        out, _ = partial_attention(q, lat[:, None], lat[:, None], scale, causal=True)
        return out

    return attend
