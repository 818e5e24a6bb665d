"""Attention of a query over one block, and the log-sum-exp merge of per-block partials.

Each block's keys carry block-local RoPE. The caller rotates the query for the block it reads and
passes how far each query row may look into the block (`limit`: key i is visible iff i <= limit).
LSE is kept in natural log end to end.
"""

from __future__ import annotations

import torch


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, limit: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over k, v [L, Hkv, D]; returns (out [T, Hq, D] fp32, lse [T, Hq] fp32).

    Grouped-query attention: query head h reads key head h // (Hq // Hkv). `limit` [T] masks key i
    for row t unless i <= limit[t]; None means every key is visible. Every row must see at least one key.
    """
    t, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    qf = q.to(torch.float32).reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, t * group, d)
    kf = k.to(torch.float32).permute(1, 2, 0)  # [Hkv, D, L]
    vf = v.to(torch.float32).permute(1, 0, 2)  # [Hkv, L, D]
    scores = torch.bmm(qf, kf).mul_(scale).view(hkv, t, group, length)
    if limit is not None:
        hidden = torch.arange(length, device=q.device)[None, :] > limit[:, None]  # [T, L]
        scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, T, G]
    probs = torch.exp(scores - lse[..., None]).view(hkv, t * group, length)
    out = torch.bmm(probs, vf).view(hkv, t, group, d).permute(1, 0, 2, 3).reshape(t, hq, d)
    return out, lse.permute(1, 0, 2).reshape(t, hq)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge per-block partial attentions: weights exp(lse_j - logsumexp_j lse_j) (split-K style)."""
    if len(outs) == 1:
        return outs[0]
    lse = torch.stack(lses)  # [B, T, H]
    weights = torch.softmax(lse, dim=0)[..., None]
    return (torch.stack(outs) * weights).sum(dim=0)
