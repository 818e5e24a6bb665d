"""Attention of a query over one run of keys, and the log-sum-exp merge of partial results.

Each block's keys carry block-local RoPE; the caller rotates the query for the block it reads.
A run is either wholly visible to every query row, or `causal`: its last T keys are the T query
rows' own tokens, so row t sees keys 0..L-T+t (a writer block's old tokens and the ones it writes in
this step, in one run). LSE is natural-log end to end.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# The CPU flash kernel returns the LSE we need for merging, without materialising the scores.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over k, v [L, Hkv, D] -> (out [T, Hq, D] fp32, lse [T, Hq] fp32).

    Grouped-query attention: query head h reads key head h // (Hq // Hkv). With `causal`, L >= T and
    row t sees keys 0..L-T+t.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    # Fold the query heads of a group into rows: [1, Hkv, T*G, D] against [1, Hkv, L, D]. The kernel's
    # own causal flag masks a square run with one query row per key row; any other causal run (folded
    # heads, earlier keys before the step's own) gets its mask, built once per shape, not per layer.
    qf = q.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(1, hkv, t * group, d)
    kf, vf = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]
    flash = _CPU_FLASH is not None and q.device.type == "cpu"
    square = flash and causal and group == 1 and k.shape[0] == t
    mask = _tail_causal_mask(t, k.shape[0], group, q.dtype, q.device) if causal and not square else None
    if flash:
        out, lse = _CPU_FLASH(qf, kf, vf, 0.0, square, attn_mask=mask, scale=scale)
    else:
        out, lse = _reference(qf, kf, vf, scale, mask)
    out = out[0].float().view(hkv, t, group, d).permute(1, 0, 2, 3).reshape(t, hq, d)
    return out, lse[0].float().view(hkv, t, group).permute(1, 0, 2).reshape(t, hq)


@lru_cache(maxsize=4)  # a step's chunk shapes; each up to T*G*L elements
def _tail_causal_mask(
    t: int, length: int, group: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[1, 1, T*G, L] additive mask (0 or -inf, in the query dtype, as the CPU flash kernel wants):
    folded row t*G+g sees keys 0..L-T+t."""
    last = torch.arange(t * group, device=device) // group + (length - t)
    hidden = torch.arange(length, device=device)[None, :] > last[:, None]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return mask[None, None]


def _reference(qf, kf, vf, scale: float, mask: torch.Tensor | None):
    scores = torch.matmul(qf.float(), kf.float().transpose(-1, -2)) * scale  # [1, Hkv, T*G, L]
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), vf.float()), lse


def reference_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention's contract in the plain, slow math: key heads expanded to the query heads,
    float64 scores, an explicit causal mask. The reference the fast paths are tested against."""
    group = q.shape[1] // k.shape[1]
    t, length = q.shape[0], k.shape[0]
    k64 = k.double().repeat_interleave(group, dim=1)  # query head h reads key head h // group
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), k64) * scale
    if causal:  # row i sees keys 0..L-T+i
        rows, keys = torch.arange(t, device=q.device), torch.arange(length, device=q.device)
        scores = scores.masked_fill(keys[None, None, :] > rows[None, :, None] + (length - t), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    out = torch.einsum("htl,lhd->thd", torch.exp(scores - lse[..., None]), v64)
    return out.float(), lse.t().float()


def reference_merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """merge_partials in float64: sum_j exp(lse_j - logsumexp_j lse_j) out_j."""
    total = torch.logsumexp(torch.stack(lses).double(), dim=0)
    weighted = [torch.exp(lse.double() - total)[..., None] * out.double() for out, lse in zip(outs, lses)]
    return torch.stack(weighted).sum(dim=0).float()


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge partial attentions over disjoint key runs: weights exp(lse_j - logsumexp_j lse_j)."""
    if len(outs) == 1:
        return outs[0]
    weights = torch.softmax(torch.stack(lses), dim=0)[..., None]  # [runs, T, H, 1]
    return (torch.stack(outs) * weights).sum(dim=0)


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per run, runs padded to a common length: the batched decode path.

    q [R, Hq, D]; k, v [R, L, Hkv, D]; valid [R, L] marks real keys. Returns (out [R, Hq, D] fp32,
    lse [R, Hq] fp32). Every run must have at least one valid key.
    """
    r, hq, d = q.shape
    hkv = k.shape[2]
    qf = q.float().view(r, hkv, hq // hkv, d)
    scores = torch.matmul(qf, k.float().permute(0, 2, 3, 1)) * scale  # [R, Hkv, G, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float().permute(0, 2, 1, 3))  # [R, Hkv, G, D]
    return out.reshape(r, hq, d), lse.reshape(r, hq)


def merge_grouped(out: torch.Tensor, lse: torch.Tensor, owner: torch.Tensor, groups: int) -> torch.Tensor:
    """merge_partials for many rows at once: rows with the same owner index are merged together."""
    top = torch.full((groups, lse.shape[1]), float("-inf"), device=lse.device)
    top = top.scatter_reduce(0, owner[:, None].expand_as(lse), lse, reduce="amax")
    weight = torch.exp(lse - top[owner])  # [R, H]
    num = torch.zeros(groups, *out.shape[1:], device=out.device).index_add_(0, owner, out * weight[..., None])
    den = torch.zeros(groups, lse.shape[1], device=lse.device).index_add_(0, owner, weight)
    return num / den[..., None]
