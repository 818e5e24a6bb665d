"""Checkpoint tensors of the hybrid MoE families brought to the layouts cothink's modules hold.

Qwen3-Next stores a Gated DeltaNet layer's input projections fused and grouped per key head:
`in_proj_qkvz` rows are, for each of the HK key heads, [q (K) | k (K) | v (r*V) | z (r*V)] with
r = HV / HK value heads per key head, and `in_proj_ba` rows [b (r) | a (r)] per key head. The Qwen3.5
layout (models/transformer.py GatedDeltaNet) holds `in_proj_qkv` = [all q | all k | all v],
`in_proj_z`, `in_proj_b`, `in_proj_a`. The map is a row permutation: outputs are equal to the bit.
"""

from __future__ import annotations

import torch

from cothink.errors import UnsupportedModelError
from cothink.models.config import GDNConfig


def split_qwen3_next_projections(state: dict[str, torch.Tensor], prefix: str, gdn: GDNConfig) -> None:
    """Replace `<prefix>.in_proj_qkvz.weight` and `<prefix>.in_proj_ba.weight` in `state` by the Qwen3.5
    layout's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` weights, in place (`prefix` names the
    layer's `linear_attn`). UnsupportedModelError names a missing or misshapen tensor."""
    hk, hv, k, v = gdn.num_k_heads, gdn.num_v_heads, gdn.k_dim, gdn.v_dim
    if hv % hk:
        raise UnsupportedModelError(
            f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}"
        )
    r = hv // hk
    qkvz = _take(state, f"{prefix}.in_proj_qkvz.weight", hk * (2 * k + 2 * r * v))
    ba = _take(state, f"{prefix}.in_proj_ba.weight", hk * 2 * r)
    hidden = qkvz.shape[1]
    if ba.shape[1] != hidden:
        raise UnsupportedModelError(
            f"{prefix}.in_proj_ba.weight has {ba.shape[1]} columns, expected {hidden}"
        )
    q, kk, vv, z = qkvz.view(hk, 2 * k + 2 * r * v, hidden).split([k, k, r * v, r * v], dim=1)
    b, a = ba.view(hk, 2 * r, hidden).split([r, r], dim=1)
    state[f"{prefix}.in_proj_qkv.weight"] = torch.cat([x.reshape(-1, hidden) for x in (q, kk, vv)])
    state[f"{prefix}.in_proj_z.weight"] = z.reshape(-1, hidden).clone()
    state[f"{prefix}.in_proj_b.weight"] = b.reshape(hv, hidden).clone()
    state[f"{prefix}.in_proj_a.weight"] = a.reshape(hv, hidden).clone()


def _take(state: dict[str, torch.Tensor], key: str, rows: int) -> torch.Tensor:
    tensor = state.pop(key, None)
    if tensor is None:
        raise UnsupportedModelError(f"Gated DeltaNet tensor {key} is missing")
    if tensor.dim() != 2 or tensor.shape[0] != rows:
        raise UnsupportedModelError(
            f"Gated DeltaNet tensor {key} has shape {tuple(tensor.shape)}, expected {rows} rows"
        )
    return tensor
