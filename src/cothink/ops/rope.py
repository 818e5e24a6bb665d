"""Rotary position embedding, applied at arbitrary (possibly negative) positions.

Keys are rotated once, at block-local positions, when they are written. A query is rotated per
block it reads, to its position relative to that block's start (docs/architecture.md). Frequencies come from
`transformers.modeling_rope_utils` so llama3, YaRN and linear scaling match the reference exactly;
the YaRN attention factor scales cos/sin, so it lands once on q and once on k, as in transformers.
"""

from __future__ import annotations

from typing import Any

import torch


class Rotary:
    def __init__(self, hf_text_config: Any, head_dim: int, device: torch.device | str = "cpu"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = dict(getattr(hf_text_config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        partial = float(params.get("partial_rotary_factor", 1.0))
        self.rotary_dim = int(head_dim * partial)
        if rope_type == "default":
            base = float(params.get("rope_theta", 10000.0))
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
            inv_freq, scaling = 1.0 / (base**exponent), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_text_config, torch.device("cpu"))
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.scaling = float(scaling)
        # multimodal RoPE (Qwen3.5, Qwen3-VL): which axis (0 t, 1 h, 2 w) rotates each frequency under
        # the interleaved layout; None for 1-D models
        section = params.get("mrope_section")
        self.mrope_axes = _mrope_axes(self.inv_freq.numel(), section, device) if section else None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [len(positions), rotary_dim] in fp32 (halves duplicated, HF layout).

        On CPU, non-negative positions are looked up in a table computed with the same formula
        (grown by doubling), so a step pays two index ops per run instead of building them."""
        if positions.device.type == "cpu" and positions.numel():
            lo, hi = int(positions.min()), int(positions.max())
            if lo >= 0:
                if hi >= self._table_size:
                    self._grow(hi + 1)
                return self._cos[positions], self._sin[positions]
        return self._compute(positions)

    _table_size = 0

    def _grow(self, n: int) -> None:
        size = max(n, 2 * self._table_size, 1024)
        self._cos, self._sin = self._compute(torch.arange(size, device=self.inv_freq.device))
        self._table_size = size
        self._prepared: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepared(
        self, positions: torch.Tensor | range, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prepare(*cos_sin(positions), dtype)`, looked up in a prepared table when the positions
        allow (CPU, non-negative): two index ops per key run instead of building the tables. A
        `range` of non-negative positions (a step's runs: positions relative to a block) takes two
        slices of the table, no index op, on any device."""
        if isinstance(positions, range):
            assert positions.step == 1 and positions.start >= 0
            cos, sin = self._prepared_table(positions.stop, dtype)
            return cos[positions.start : positions.stop], sin[positions.start : positions.stop]
        if positions.device.type != "cpu" or not positions.numel() or int(positions.min()) < 0:
            return self.prepare(*self.cos_sin(positions), dtype)
        table = self._prepared_table(int(positions.max()) + 1, dtype)
        return table[0][positions], table[1][positions]

    def _prepared_table(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The prepared tables in `dtype` for at least positions 0..size-1."""
        if size > self._table_size or not self._table_size:
            self._grow(size)
        table = self._prepared.get(dtype)
        if table is None:
            table = self._prepared[dtype] = self.prepare(self._cos, self._sin, dtype)
        return table

    def prepared3(self, pos3: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepared tables (`prepare`) for 3-D positions pos3 [3, T] (rows t, h, w): each frequency
        rotates by its axis's position. At equal axes this is the 1-D table at that position."""
        assert self.mrope_axes is not None, "3-D positions need a multimodal RoPE (mrope_section)"
        freqs = pos3.to(self.inv_freq.device, torch.float32)[:, :, None] * self.inv_freq  # [3, T, F]
        freqs = freqs.gather(0, self.mrope_axes.expand(freqs.shape[1], -1)[None])[0]  # [T, F]
        emb = torch.cat((freqs, freqs), dim=-1)
        return self.prepare(emb.cos() * self.scaling, emb.sin() * self.scaling, dtype)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] so that row t sits at positions[t]."""
        return self.apply(x, *self.cos_sin(positions))

    def prepare(
        self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] -> [T, 1, rotary_dim] in `dtype`, the sign of rotate_half folded
        into sin, for `apply_prepared` (built once per step, used by every layer)."""
        half = self.rotary_dim // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype)[:, None, :], signed.to(dtype)[:, None, :]

    def apply_prepared(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`apply` with tables from `prepare`: bit-identical ((-a) * s == a * (-s)), fewer ops."""
        if self.rotary_dim == x.shape[-1]:
            return x * cos + x.roll(self.rotary_dim // 2, dims=-1) * signed_sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        out = rot * cos + rot.roll(self.rotary_dim // 2, dims=-1) * signed_sin
        return torch.cat((out, rest), dim=-1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] with precomputed cos/sin [T, rotary_dim] (see cos_sin)."""
        cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated_half * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _mrope_axes(num_freqs: int, section: list[int], device: torch.device | str) -> torch.Tensor:
    """The interleaved layout: frequency j follows h if j % 3 == 1 and j < 3 * section[1], w if
    j % 3 == 2 and j < 3 * section[2], t otherwise (transformers' Qwen3.5 / Qwen3-VL rotary)."""
    j = torch.arange(num_freqs)
    axis = torch.zeros(num_freqs, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis.to(device)
