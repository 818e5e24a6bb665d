"""The vision tower of Qwen3.5 multimodal and Qwen3-VL checkpoints in plain PyTorch.

Pixels arrive as flattened patches (models/image_processing.py): one row of `C * tp * p * p` values per
patch, patches of each 2x2 merge block consecutive, merge blocks row-major over the patch grid. The tower
embeds every patch (the checkpoint's Conv3d with kernel = stride is a linear map of the flattened patch),
adds the learned position table resampled bilinearly to the grid, runs pre-LayerNorm blocks whose
attention is non-causal within each frame (temporal step) and rotates q/k by each patch's (row, col), and
merges every 2x2 block of patches into one token of the text decoder's width. Qwen3-VL also returns the
DeepStack features: the outputs of the listed blocks, merged by their own mergers.

Every image and every frame group is independent of the others it is batched with: features are
context-free, so an image can be encoded ahead of time and a stream group by group.

The forward pass also runs in resumable stages, so the scheduler can spread one image over several
steps: `start` (patch and position embedding, rotary tables) -> `run_blocks` (the next n blocks) or
`run` (about a given amount of work, patches x blocks, cut inside a block) any number of times ->
`finish` (the merger). A block is two row-wise phases: (1) norm1 and the rotated q/k/v of a range of
patch rows, kept in the state; (2) once every row has its q/k/v, the attention of a range of rows
(each row reads its whole frame's keys), proj, residual and the MLP. So work can stop after any row of
either phase. Cut between blocks (`run_blocks`) the stages are bit-identical to `forward`; cut inside a
block, the same arithmetic runs on fewer rows at a time, which matrix kernels may round differently
(tests hold it to 1e-5 of the features' scale).

Parameter names follow the checkpoint under `model.visual.` so the weights load by name
(models/weights.py::load_vision_tower); the patch embedding's Conv3d weight is stored flattened.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cothink.errors import InvalidParameterError, UnsupportedModelError
from cothink.models.config import VisionConfig

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True, slots=True)
class PatchGrid:
    """One image or one video's patch grid before the merge: `t` temporal steps of `h x w` patches."""

    t: int  # temporal steps (1 for an image; frames / temporal_patch_size for a video)
    h: int  # patch rows (a multiple of the merge size)
    w: int  # patch columns (a multiple of the merge size)

    @property
    def patches(self) -> int:
        return self.t * self.h * self.w

    def tokens(self, merge: int) -> int:
        """Tokens of the text decoder this grid becomes (t * h/merge * w/merge)."""
        return self.t * (self.h // merge) * (self.w // merge)


@dataclass(frozen=True)
class VisionFeatures:
    """The tower's output for a batch of grids, rows in the order of the grids and their tokens."""

    merged: torch.Tensor  # [sum of tokens, out_hidden]: the embeddings that replace the placeholders
    deepstack: tuple[torch.Tensor, ...]  # per DeepStack layer, [sum of tokens, out_hidden] (Qwen3-VL)

    def split(self, grids: Sequence[PatchGrid], merge: int) -> list[VisionFeatures]:
        """One VisionFeatures per grid."""
        sizes = [g.tokens(merge) for g in grids]
        merged = self.merged.split(sizes)
        stacks = [d.split(sizes) for d in self.deepstack]
        return [VisionFeatures(m, tuple(s[i] for s in stacks)) for i, m in enumerate(merged)]


@dataclass
class EncodeState:
    """A batch of grids part-way through the tower: the hidden state after `done` blocks, the rotary
    tables the blocks read, and the DeepStack features of the blocks already run."""

    x: torch.Tensor  # [patches, hidden] in the tower's dtype
    cos: torch.Tensor  # [patches, head_dim] fp32
    sin: torch.Tensor
    frames: list[tuple[int, int]]  # (count, length) runs of equal-length frames, one per grid
    done: int = 0  # blocks run
    deepstack: list[torch.Tensor] = field(default_factory=list)  # merged outputs of the listed blocks run
    # inside block `done`: the phase (0: q/k/v, 1: attention and MLP) and the rows it has run
    phase: int = 0
    row: int = 0
    qkv: torch.Tensor | None = None  # [patches, 3, heads, head_dim], q and k rotated: block `done`'s

    @property
    def patches(self) -> int:
        return self.x.shape[0]

    def nbytes(self) -> int:
        """Memory the state holds between stages, at its largest (the q/k/v of a block allocated; the
        DeepStack features not included)."""
        qkv = 3 * self.x.numel() * self.x.element_size()
        return qkv + sum(t.numel() * t.element_size() for t in (self.x, self.cos, self.sin))


def rotary_frequencies(cfg: VisionConfig) -> torch.Tensor:
    """The 2-D rotary's inverse frequencies [head_dim / 4] fp32: half the head rotates by the patch's row,
    half by its column, each half in rotate_half pairs."""
    spatial = cfg.head_dim // 2
    return 1.0 / cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"vision activation {cfg.hidden_act!r} is not supported")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    """Non-causal attention within each frame; q and k rotated by the patches' (row, col)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        """x [N, hidden]; cos/sin [N, head_dim] fp32; frames: (count, length) runs of equal-length frames."""
        return self.proj(self.attend(self.rotated_qkv(x, cos, sin), frames, 0, x.shape[0]))

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[n, 3, heads, head_dim] of n rows, q and k rotated (in fp32, as the reference does)."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for i in (0, 1):
            t = qkv[:, i].float()
            qkv[:, i] = (t * cos + _rotate_half(t) * sin).to(x.dtype)
        return qkv

    def attend(self, qkv: torch.Tensor, frames: Sequence[tuple[int, int]], r0: int, r1: int) -> torch.Tensor:
        """The attention output [r1 - r0, hidden] (before proj) of rows r0..r1, each row reading its whole
        frame: whole frames of a grid in one batched call, the rows of a cut frame in one call."""
        q, k, v = qkv.unbind(1)
        out = []
        for a, b, keys, n in _frame_pieces(frames, r0, r1):
            shape = (n, -1, self.num_heads, self.head_dim)
            o = F.scaled_dot_product_attention(  # [n, heads, rows per frame, D]
                q[a:b].reshape(shape).transpose(1, 2),
                k[keys].reshape(shape).transpose(1, 2),
                v[keys].reshape(shape).transpose(1, 2),
            )
            out.append(o.transpose(1, 2).reshape(b - a, -1))
        return torch.cat(out)


def _frame_pieces(
    frames: Sequence[tuple[int, int]], r0: int, r1: int
) -> Iterator[tuple[int, int, slice, int]]:
    """Rows r0..r1 as pieces (a, b, keys, n): rows a..b read the key rows `keys`, n frames of them;
    a piece is either n whole frames (keys = a..b) or some rows of one frame (n = 1)."""
    start = 0
    for count, length in frames:  # (count, length) runs of equal-length frames
        end = start + count * length
        a, b = max(r0, start), min(r1, end)
        while a < b:
            first = start + (a - start) // length * length  # the frame row a is in
            whole = (b - first) // length if a == first else 0
            if whole:
                cut = first + whole * length
                yield a, cut, slice(first, cut), whole
            else:
                cut = min(b, first + length)
                yield a, cut, slice(first, first + length), 1
            a = cut
        start = end


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        return self.rest(x, self.qkv(x, cos, sin), frames, 0, x.shape[0])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Phase 1 of rows x (cos/sin theirs): their rotated q/k/v."""
        return self.attn.rotated_qkv(self.norm1(x), cos, sin)

    def rest(
        self, x: torch.Tensor, qkv: torch.Tensor, frames: Sequence[tuple[int, int]], r0: int, r1: int
    ) -> torch.Tensor:
        """Phase 2: rows r0..r1 of the block's output, given every row's q/k/v and x = rows r0..r1."""
        x = x + self.attn.proj(self.attn.attend(qkv, frames, r0, r1))
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge patches -> one token: LayerNorm (per patch, or over the merged vector for the
    DeepStack mergers), then fc1, GELU (erf), fc2."""

    def __init__(self, cfg: VisionConfig, norm_after_merge: bool):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.merge_unit
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.merged_dim if norm_after_merge else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_merge:
            x = self.norm(x.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        # the checkpoint's Conv3d (kernel = stride = (tp, p, p)) as a linear map of the flattened patch
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    """pixel patches [N, patch_dim] of a batch of grids -> VisionFeatures (merged tokens, DeepStack)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        side = round(cfg.num_position_embeddings**0.5)
        if side * side != cfg.num_position_embeddings:
            raise UnsupportedModelError(
                f"num_position_embeddings {cfg.num_position_embeddings} is not a square grid")
        if cfg.head_dim % 4:
            raise UnsupportedModelError(f"vision head_dim {cfg.head_dim} is not a multiple of 4 (2-D rotary)")
        self.config, self.side = cfg, side
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, norm_after_merge=True) for _ in cfg.deepstack_layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def state_row_bytes(self) -> int:
        """Bytes one patch takes in an EncodeState between stages, at most: its hidden row, its q/k/v
        rows and its rotary rows."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return 4 * self.config.hidden_size * size + 2 * self.config.head_dim * 4

    def patch_block_macs(self) -> int:
        """Multiply-adds of one patch through one block's matrices (q/k/v, proj, MLP; the attention
        scores, which grow with the frame, left out)."""
        h, i = self.config.hidden_size, self.config.intermediate_size
        return 4 * h * h + 2 * h * i

    def phase_shares(self) -> tuple[float, float]:
        """Each phase's part of a block's work, by multiply-adds per row (the attention scores, which
        grow with the frame, left out): q/k/v 3h^2; proj h^2 and the MLP 2hI."""
        h = self.config.hidden_size
        first = 3 * h * h / self.patch_block_macs()
        return first, 1.0 - first

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[PatchGrid]) -> VisionFeatures:
        state = self.start(pixel_values, grids)
        self.run_blocks(state, self.depth)
        return self.finish(state)

    def start(self, pixel_values: torch.Tensor, grids: Sequence[PatchGrid]) -> EncodeState:
        """Embed the patches (position embedding added) and build the rotary tables: no block run yet."""
        grids = list(grids)
        self._check(pixel_values, grids)
        x = self.patch_embed(pixel_values)
        x = x + torch.cat([self._position_embedding(g) for g in grids]).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)
        return EncodeState(x, cos, sin, [(g.t, g.h * g.w) for g in grids])

    def run_blocks(self, state: EncodeState, n: int) -> None:
        """Run the next n blocks (fewer if fewer are left; a block begun by `run` counts as one) on the
        state, with the DeepStack mergers of the listed blocks among them."""
        end = min(self.depth, state.done + n)
        while state.done < end:
            self._run_rows(state, state.patches)

    def run(self, state: EncodeState, patch_blocks: float) -> float:
        """Run about `patch_blocks` of work (patches x blocks, each phase weighed by `phase_shares`):
        as many rows as fit, at least one; returns the work run."""
        shares, ran = self.phase_shares(), 0.0
        while state.done < self.depth:
            share = shares[state.phase]
            rows = int((patch_blocks - ran) / share + 1e-9)
            if rows < 1:
                if ran:
                    break
                rows = 1  # the encode always advances
            rows = self._run_rows(state, rows)
            ran += rows * share
        return ran

    def _run_rows(self, state: EncodeState, rows: int) -> int:
        """Run up to `rows` rows of the current phase (not past its end); returns the rows run."""
        block, n = self.blocks[state.done], state.patches
        r0 = state.row
        r1 = min(n, r0 + rows)
        if state.phase == 0:
            qkv = block.qkv(state.x[r0:r1], state.cos[r0:r1], state.sin[r0:r1])
            if r0 == 0 and r1 == n:
                state.qkv = qkv
            else:
                if state.qkv is None:
                    state.qkv = qkv.new_empty((n, *qkv.shape[1:]))
                state.qkv[r0:r1] = qkv
        else:
            assert state.qkv is not None
            out = block.rest(state.x[r0:r1], state.qkv, state.frames, r0, r1)
            if r0 == 0 and r1 == n:
                state.x = out
            else:  # every row's q/k/v is made: the block's input rows are not read again
                state.x[r0:r1] = out
        state.row = r1 if r1 < n else 0
        if r1 == n:
            state.phase ^= 1
            if state.phase == 0:  # the block is done
                state.qkv = None
                layers = self.config.deepstack_layers
                if state.done in layers:
                    state.deepstack.append(self.deepstack_merger_list[layers.index(state.done)](state.x))
                state.done += 1
        return r1 - r0

    def finish(self, state: EncodeState) -> VisionFeatures:
        """The merged features of a state that has run every block."""
        if state.done != self.depth:
            raise InvalidParameterError(
                f"the encode has run {state.done} of {self.depth} blocks", param="state")
        return VisionFeatures(self.merger(state.x), tuple(state.deepstack))

    def _check(self, pixel_values: torch.Tensor, grids: list[PatchGrid]) -> None:
        m = self.config.spatial_merge_size
        if any(g.t < 1 or g.h < m or g.w < m or g.h % m or g.w % m for g in grids):
            raise InvalidParameterError(f"patch grids {grids} are not multiples of the merge size {m}",
                                        param="image")
        want = (sum(g.patches for g in grids), self.config.patch_dim)
        if tuple(pixel_values.shape) != want:
            raise InvalidParameterError(
                f"pixel values of shape {tuple(pixel_values.shape)} do not match the grids ({want})",
                param="image")

    def _position_embedding(self, g: PatchGrid) -> torch.Tensor:
        """The learned square table resampled bilinearly (corners aligned) to h x w, in merge-block order,
        repeated for each temporal step: [t*h*w, hidden] fp32."""
        m, side, hidden = self.config.spatial_merge_size, self.side, self.config.hidden_size
        table = self.pos_embed.weight.float().view(side, side, hidden).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(g.h, g.w), mode="bilinear", align_corners=True)[0]
        grid = grid.view(hidden, g.h // m, m, g.w // m, m).permute(1, 3, 2, 4, 0).reshape(g.h * g.w, hidden)
        return grid.repeat(g.t, 1)

    def _rotary(self, grids: list[PatchGrid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim] fp32: frequencies [row * f, col * f], duplicated for rotate_half."""
        m = self.config.spatial_merge_size
        rows, cols = [], []
        for g in grids:
            r, c = torch.meshgrid(torch.arange(g.h, device=device), torch.arange(g.w, device=device),
                                  indexing="ij")
            blocks = (g.h // m, m, g.w // m, m)  # merge-block order, as the patches are laid out
            rows.append(r.reshape(blocks).transpose(1, 2).flatten().repeat(g.t))
            cols.append(c.reshape(blocks).transpose(1, 2).flatten().repeat(g.t))
        inv_freq = rotary_frequencies(self.config).to(device)  # fp32 whatever the tower's dtype
        freqs = torch.cat([torch.cat(rows)[:, None] * inv_freq, torch.cat(cols)[:, None] * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()
