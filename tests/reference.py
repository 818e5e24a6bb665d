"""A slow, obviously-correct reference for views, working from a runner's stored memory.

`reference_logits(runner, view, token_ids)` returns the logits that appending `token_ids` after the
blocks of `view` must give, computed in float64 with none of cothink's attention, GDN or linear-state
code (only the runner's module weights and what the runner stored for each block):

- full attention: every stored key (rotated at block-local position i) is rotated further by its block's
  view offset o, the sum of the spans before it (RoPE rotations compose: R(o) R(i) = R(o + i)), new keys
  and queries (text) are rotated at their absolute view positions, and plain causal softmax attention
  runs over the concatenation;
- Gated DeltaNet: the view blocks' stored pre-conv rows, log decays g and betas are concatenated with the
  new tokens' ones, the depthwise causal conv runs over the whole concatenation from a zero history, and
  the delta rule is replayed one token at a time in an explicit Python loop.

Call it BEFORE `runner.extend` so it sees the same memory the runner reads. Also small test utilities.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

ATOL = 1e-4  # the tolerance for fp32 logits
DT = torch.float64


def random_ids(n: int, seed: int | random.Random, vocab: int = 300) -> list[int]:
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ---- plain math -----------------------------------------------------------------------------------
def _w(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(DT)


def _linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    y = x @ _w(module.weight).T
    return y + _w(module.bias) if module.bias is not None else y


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    w = _w(weight)
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if zero_centred else y * w


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class RefRope:
    """RoPE frequencies from transformers' own rotary module for the family; angles in float64."""

    def __init__(self, runner):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

        if runner.config.family == "kimi_linear":  # MLA without RoPE: nothing rotates
            self.inv_freq, self.scaling, self.rotary_dim = torch.zeros(0, dtype=DT), 1.0, 0
            return
        cls = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "qwen3": Qwen3RotaryEmbedding,
               "qwen3_5": Qwen3_5TextRotaryEmbedding, "qwen3_5_moe": Qwen3_5MoeTextRotaryEmbedding,
               "qwen3_next": Qwen3NextRotaryEmbedding}[runner.config.family]
        hf = cls(config=runner.config.hf_text_config)
        self.inv_freq = hf.inv_freq.detach().to(DT)
        self.scaling = float(hf.attention_scaling)  # YaRN's attention factor multiplies cos and sin
        self.rotary_dim = 2 * self.inv_freq.numel()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        """Rotate x [T, H, D] by positions [T] (first rotary_dim channels, halves layout as in HF)."""
        angles = positions.to(DT)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        if scaled:
            cos, sin = cos * self.scaling, sin * self.scaling
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)


def _causal_attention(q, k, v, q_pos, k_pos, scale):
    """q [T, H, D], k/v [L, Hkv, D]; key j visible to query t iff k_pos[j] <= q_pos[t]."""
    rep = q.shape[1] // k.shape[1]
    # query head h reads kv head h // rep
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v)


# ---- the reference forward -----------------------------------------------------------------------
@torch.no_grad()
def reference_logits(runner, view: list, token_ids: list[int]) -> torch.Tensor:
    """float64 logits [len(token_ids), vocab] of token_ids appended after the blocks of `view`.

    `view` lists already written blocks in view order; it may end with the block being written (with
    its current content) or leave it out when that block is still empty.
    """
    cfg, store, model = runner.config, runner.store, runner.model
    rope = RefRope(runner)
    lengths = [b.length for b in view]
    # a block's span: one position per text token, max(rows, cols) for an image's grid (stored keys of
    # an image sit at 3-D positions; moving them by o on every axis is the 1-D rotation by o)
    spans = [b.position_span for b in view]
    offsets = [sum(spans[:j]) for j in range(len(view))]
    past = sum(spans)
    n = len(token_ids)
    new_pos = torch.arange(past, past + n)
    eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm

    x = _w(model.model.embed_tokens.weight)[torch.tensor(token_ids)]
    for index, layer in enumerate(model.model.layers):
        h = _rms_norm(x, layer.input_layernorm.weight, eps, zc)
        linear = cfg.layer_types[index] == "linear_attention"
        if cfg.mla is not None and not linear:
            slot = store.attn_slot[index]
            mix = _mla_layer(runner, layer.self_attn, slot, view, lengths, offsets, h, new_pos)
        elif linear and cfg.gdn is None:
            mix = _kda_layer(cfg, layer.self_attn, store.linear_slot[index], view, lengths, h)
        elif hasattr(layer, "self_attn"):
            slot = store.attn_slot[index]
            mix = _attention_layer(runner, rope, layer.self_attn, slot, view, lengths, offsets, h, new_pos)
        else:
            mix = _gdn_layer(cfg, layer.linear_attn, store.linear_slot[index], view, lengths, h)
        x = x + mix
        h = _rms_norm(x, layer.post_attention_layernorm.weight, eps, zc)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            x = x + _moe(h, mlp, cfg.family_config.moe)
        else:
            x = x + _gated_mlp(h, mlp)
    x = _rms_norm(x, model.model.norm.weight, eps, zc)
    return x @ _w(model.lm_head.weight).T


def _attention_layer(runner, rope, attn, slot, view, lengths, offsets, h, new_pos):
    cfg, store = runner.config, runner.store
    n, d = h.shape[0], cfg.head_dim
    q = _linear(h, attn.q_proj).view(n, cfg.num_heads, -1)
    gate = None
    if cfg.attn_output_gate:  # per head: [query | gate]
        q, gate = q[..., :d], q[..., d:].reshape(n, -1)
    k = _linear(h, attn.k_proj).view(n, cfg.num_kv_heads, d)
    v = _linear(h, attn.v_proj).view(n, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = _rms_norm(q, attn.q_norm.weight, cfg.rms_norm_eps, cfg.zero_centred_norm)
        k = _rms_norm(k, attn.k_norm.weight, cfg.rms_norm_eps, cfg.zero_centred_norm)
    keys, values, key_pos = [], [], []
    for block, length, offset in zip(view, lengths, offsets):
        if length == 0:
            continue
        slots = store.slots(block, 0, length)
        stored_k = store.pool.k[slot, slots].to(DT)  # rotated at block-local positions 0..length-1
        # R(offset) R(i) = R(offset + i); unscaled: the stored key already carries the YaRN factor once
        keys.append(rope.rotate(stored_k, torch.full((length,), offset), scaled=False))
        values.append(store.pool.v[slot, slots].to(DT))
        key_pos.append(torch.full((length,), offset))  # every view key precedes the new tokens
    keys.append(rope.rotate(k, new_pos))
    values.append(v)
    key_pos.append(new_pos)
    out = _causal_attention(rope.rotate(q, new_pos), torch.cat(keys), torch.cat(values), new_pos,
                            torch.cat(key_pos), d**-0.5).reshape(n, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return _linear(out, attn.o_proj)


def _gdn_layer(cfg, mixer, slot, view, lengths, h):
    g_cfg, n = cfg.gdn, h.shape[0]
    hv, kd, vd = g_cfg.num_v_heads, g_cfg.k_dim, g_cfg.v_dim
    rows_new = _linear(h, mixer.in_proj_qkv)
    beta_new = torch.sigmoid(_linear(h, mixer.in_proj_b))
    g_new = -torch.exp(_w(mixer.A_log)) * F.softplus(_linear(h, mixer.in_proj_a) + _w(mixer.dt_bias))
    rows = [b.linear[slot].rows.data[:ln].to(DT) for b, ln in zip(view, lengths)] + [rows_new]
    gs = [b.linear[slot].g.data[:ln].to(DT) for b, ln in zip(view, lengths)] + [g_new]
    betas = [b.linear[slot].beta.data[:ln].to(DT) for b, ln in zip(view, lengths)] + [beta_new]
    rows, gs, betas = torch.cat(rows), torch.cat(gs), torch.cat(betas)
    total, before = rows.shape[0], rows.shape[0] - n

    # depthwise causal conv from a zero history, then SiLU
    weight = _w(mixer.conv1d.weight)[:, 0, :]  # [C, W]
    width = weight.shape[1]
    padded = torch.cat((rows.new_zeros(width - 1, rows.shape[1]), rows))
    conv = sum(padded[j : j + total] * weight[:, j] for j in range(width))
    post = F.silu(conv)

    q, k, v = post.split([g_cfg.key_dim, g_cfg.key_dim, g_cfg.value_dim], dim=-1)
    rep = hv // g_cfg.num_k_heads  # value head h reads key head h // rep
    q = _l2norm(q.reshape(total, -1, kd)).repeat_interleave(rep, dim=1) * kd**-0.5
    k = _l2norm(k.reshape(total, -1, kd)).repeat_interleave(rep, dim=1)
    v = v.reshape(total, hv, vd)

    state = torch.zeros(hv, kd, vd, dtype=DT)
    outs = []
    for t in range(total):
        state = torch.exp(gs[t])[:, None, None] * state
        recalled = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t][:, :, None] * (betas[t][:, None] * (v[t] - recalled))[:, None, :]
        if t >= before:
            outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    core = torch.stack(outs)  # [n, HV, V]

    z = _linear(h, mixer.in_proj_z).view(n, hv, vd)
    normed = _rms_norm(core, mixer.norm.weight, cfg.rms_norm_eps, zero_centred=False) * F.silu(z)
    return _linear(normed.reshape(n, -1), mixer.out_proj)


def _gated_mlp(h, mlp):
    return _linear(F.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)


def _moe(h, block, moe):
    """A sparse MoE block: the family's router (softmax or sigmoid + correction bias + groups), each
    token's k experts one at a time, the shared expert (gated for Qwen)."""
    t = h.shape[0]
    logits = h @ _w(block.gate.weight).T
    if moe.router == "softmax":
        weights, experts = logits.softmax(-1).topk(moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores + _w(block.gate.e_score_correction_bias)
        if moe.topk_group < moe.num_groups:
            per_group = choice.view(t, moe.num_groups, -1)
            best = per_group.topk(2, dim=-1)[0].sum(-1).topk(moe.topk_group, dim=-1)[1]
            keep = torch.zeros(t, moe.num_groups, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep[:, :, None].expand_as(per_group).reshape(t, -1), float("-inf"))
        experts = choice.topk(moe.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * moe.routed_scaling_factor
    out = torch.zeros_like(h)
    for i in range(t):
        for j in range(moe.top_k):
            e = int(experts[i, j])
            gate, up = (h[i] @ _w(block.experts.gate_up_proj[e]).T).chunk(2)
            out[i] += weights[i, j] * ((F.silu(gate) * up) @ _w(block.experts.down_proj[e]).T)
    shared = block.shared
    if shared is not None:
        extra = _gated_mlp(h, shared)
        if block.shared_expert_gate is not None:
            extra = torch.sigmoid(_linear(h, block.shared_expert_gate)) * extra
        out = out + extra
    return out


def _kda_layer(cfg, mixer, slot, view, lengths, h):
    """Kimi Delta Attention: stored pre-conv rows, per-channel log decays and betas of the view's
    blocks, then the new tokens'; the conv from a zero history; the recurrence in a Python loop."""
    kda, n = cfg.family_config.kda, h.shape[0]
    heads, kd = kda.num_heads, kda.head_dim
    rows_new = torch.cat([_linear(h, mixer.q_proj), _linear(h, mixer.k_proj), _linear(h, mixer.v_proj)], -1)
    beta_new = torch.sigmoid(_linear(h, mixer.b_proj))
    a = (_linear(_linear(h, mixer.f_a_proj), mixer.f_b_proj) + _w(mixer.dt_bias)).view(n, heads, kd)
    soft = torch.where(a > 20, a, torch.log1p(torch.exp(a)))
    g_new = -torch.exp(_w(mixer.A_log).reshape(heads, 1)) * soft
    rows = torch.cat([b.linear[slot].rows.data[:ln].to(DT) for b, ln in zip(view, lengths)] + [rows_new])
    gs = torch.cat([b.linear[slot].g.data[:ln].to(DT) for b, ln in zip(view, lengths)] + [g_new])
    betas = torch.cat([b.linear[slot].beta.data[:ln].to(DT) for b, ln in zip(view, lengths)] + [beta_new])
    total, before = rows.shape[0], rows.shape[0] - n
    weight = _w(mixer.conv1d.weight)[:, 0, :]
    width = weight.shape[1]
    padded = torch.cat((rows.new_zeros(width - 1, rows.shape[1]), rows))
    post = F.silu(sum(padded[j : j + total] * weight[:, j] for j in range(width)))
    q, k, v = post.view(total, 3, heads, kd).unbind(1)
    q, k = _l2norm(q) * kd**-0.5, _l2norm(k)
    state = torch.zeros(heads, kd, kd, dtype=DT)
    outs = []
    for t in range(total):
        state = torch.exp(gs[t])[:, :, None] * state  # per key channel
        recalled = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t][:, :, None] * (betas[t][:, None] * (v[t] - recalled))[:, None, :]
        if t >= before:
            outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    core = torch.stack(outs)
    gate = _linear(_linear(h, mixer.g_a_proj), mixer.g_b_proj).view(n, heads, kd)
    normed = _rms_norm(core, mixer.o_norm.weight, kda.norm_eps, zero_centred=False) * torch.sigmoid(gate)
    return _linear(normed.reshape(n, -1), mixer.o_proj)


def _mla_layer(runner, attn, slot, view, lengths, offsets, h, new_pos):
    """Multi-head latent attention in its expanded form (per-head keys and values from the latents),
    no RoPE: the view blocks' stored latents (the pool's one head), then the new tokens'."""
    mla, store, n = runner.config.mla, runner.store, h.shape[0]
    r, dn, dr, dv = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    heads = mla.num_heads
    kv = _linear(h, attn.kv_a_proj_with_mqa)
    lat_new = torch.cat((_rms_norm(kv[:, :r], attn.kv_a_layernorm.weight, 1e-6, False), kv[:, r:]), -1)
    lats, key_pos = [], []
    for block, length, offset in zip(view, lengths, offsets):
        if length:
            lats.append(store.pool.k[slot, store.slots(block, 0, length), 0].to(DT))
            key_pos.append(torch.arange(offset, offset + length))
    lat = torch.cat([*lats, lat_new])
    w = _w(attn.kv_b_proj.weight).view(heads, dn + dv, r)
    k_nope = torch.einsum("lr,hnr->lhn", lat[:, :r], w[:, :dn])
    values = torch.einsum("lr,hvr->lhv", lat[:, :r], w[:, dn:])
    keys = torch.cat((k_nope, lat[:, None, r:].expand(-1, heads, dr)), -1)
    q = _linear(h, attn.q_proj).view(n, heads, dn + dr)
    out = _causal_attention(q, keys, values, new_pos, torch.cat([*key_pos, new_pos]), (dn + dr) ** -0.5)
    return _linear(out.reshape(n, -1), attn.o_proj)
