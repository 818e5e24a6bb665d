"""Attention of a query over one run of keys, and the log-sum-exp merge of partial results.

Each block's keys carry block-local RoPE; the caller rotates the query for the block it reads.
A run is either wholly visible to every query row, or `causal`: a square run where row t sees
keys 0..t (the tokens an item writes in this step). LSE is natural-log end to end.
"""

from __future__ import annotations

import torch

# The CPU flash kernel returns the LSE we need for merging, without materialising the scores.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over k, v [L, Hkv, D] -> (out [T, Hq, D] fp32, lse [T, Hq] fp32).

    Grouped-query attention: query head h reads key head h // (Hq // Hkv). With `causal`, T == L and
    row t sees keys 0..t.
    """
    t, hq, d = q.shape
    group = hq // k.shape[1]
    if causal and group > 1:  # a causal run needs one query row per key row: expand the key heads instead
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        group = 1
    hkv = k.shape[1]
    # Fold the query heads of a group into rows: [1, Hkv, T*G, D] against [1, Hkv, L, D].
    qf = q.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(1, hkv, t * group, d)
    kf, vf = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]
    if _CPU_FLASH is not None and q.device.type == "cpu":
        out, lse = _CPU_FLASH(qf, kf, vf, 0.0, causal, scale=scale)
    else:
        out, lse = _reference(qf, kf, vf, scale, causal, group)
    out = out[0].float().view(hkv, t, group, d).permute(1, 0, 2, 3).reshape(t, hq, d)
    return out, lse[0].float().view(hkv, t, group).permute(1, 0, 2).reshape(t, hq)


def _reference(qf, kf, vf, scale: float, causal: bool, group: int):
    scores = torch.matmul(qf.float(), kf.float().transpose(-1, -2)) * scale  # [1, Hkv, T*G, L]
    if causal:
        rows = torch.arange(scores.shape[-2], device=qf.device) // group
        hidden = torch.arange(scores.shape[-1], device=qf.device)[None, :] > rows[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), vf.float()), lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge partial attentions over disjoint key runs: weights exp(lse_j - logsumexp_j lse_j)."""
    if len(outs) == 1:
        return outs[0]
    weights = torch.softmax(torch.stack(lses), dim=0)[..., None]  # [runs, T, H, 1]
    return (torch.stack(outs) * weights).sum(dim=0)
