"""The sparse mixture-of-experts block of Qwen3.5-MoE, Qwen3-Next and Kimi Linear, in plain PyTorch.

Routing keeps each family's dtype chain, so the selected experts and their weights are those of
transformers:
- Qwen (`router="softmax"`): logits in the model dtype, softmax in fp32, `torch.topk`, renormalised
  (always for Qwen3.5-MoE, if `norm_topk_prob` for Qwen3-Next), cast back to the model dtype before
  weighting; the shared expert is scaled by sigmoid(shared_expert_gate(x)).
- Kimi (`router="sigmoid"`): fp32 logits and sigmoid scores; the correction bias is added for the
  selection only, within the best `topk_group` of `num_groups` groups (a group's score: its two best);
  the selected scores are renormalised (+1e-20) and multiplied by `routed_scaling_factor`, in fp32;
  the shared expert is added ungated.
`torch.topk` itself picks the experts (its tie order is not lowest index first).

Execution: the tokens of a step (every coroutine's rows, flattened [T, hidden]) are routed together.
Their T*k (token, expert) slots are sorted by expert; each active expert runs one GEMM pair over its
rows; the weighted slot outputs are summed per token over the k slots (transformers' grouped_mm
dtype chain: weights times outputs, one sum, one cast). Batch caveat: the router is a GEMM over the
step's rows, whose float rounding may depend on how many rows share it (fp32 ~1e-7, bfloat16 one
ulp); a token whose k-th and (k+1)-th scores are that close can select another expert in another
batch. Results are batch-invariant to float tolerance, not to the bit.

Expert weights are held fused: gate_up_proj [E, 2I, H] (rows 0..I-1 gate, then up) and down_proj
[E, H, I]. `fuse_expert_weights` turns a checkpoint's per-expert tensors into that layout. The fast
path (`split_experts`, at fusion) holds them as one linear pair per expert (`ExpertLinears`, views of
the stacked weights), which the fast path's linear replacement turns into each dtype's CPU kernel:
oneDNN-prepacked bfloat16 (bit-identical to `F.linear` on the weight's slice, and faster: no reorder of
the weight per call), float32 `CpuLinear` (float32 rounding apart), weight-only int8 (models/quantize.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cothink.errors import UnsupportedModelError
from cothink.models.moe_config import MoeConfig

# Kimi's renormalisation denominator guard (as transformers)
SIGMOID_NORM_EPS = 1e-20


@dataclass(frozen=True, slots=True)
class Routing:
    """The experts each token uses and their weights."""

    experts: torch.Tensor  # [T, k] int64 expert indices, in torch.topk's order
    weights: torch.Tensor  # [T, k]: model dtype (Qwen) or fp32 (Kimi)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: a dense layer, a shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Selects k experts per token (`weight` [E, H]; Kimi adds the buffer e_score_correction_bias [E])."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if cfg.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        if self.cfg.router == "softmax":
            return self._softmax(x)
        return self._sigmoid(x)

    def _softmax(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)  # model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts, weights.to(logits.dtype))

    def _sigmoid(self, x: torch.Tensor) -> Routing:
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if cfg.topk_group < cfg.num_groups:  # otherwise every group is selectable: no mask
            per_group = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
            groups = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep[:, :, None].expand_as(per_group).reshape(-1, cfg.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        experts = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
        return Routing(experts, weights * cfg.routed_scaling_factor)


class Experts(nn.Module):
    """The routed experts, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I] (the eager path)."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
        self.num_experts, self.intermediate_size = e, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> sum over each token's k slots of weight * expert(x), [T, H] in x's dtype."""
        t, k = routing.experts.shape
        if t == 0:
            return torch.zeros_like(x)
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slot order grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per step
        rows = x.index_select(0, order // k)
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                end = start + count
                out[start:end] = self.expert(e, rows[start:end])
                start = end
        # the weight multiplies in the weight's dtype chain (bf16 x bf16 for Qwen, bf16 x fp32 -> fp32
        # for Kimi); the k slots are summed once and cast once
        weighted = out * routing.weights.reshape(-1)[order, None]
        slots = torch.empty_like(weighted)
        slots[order] = weighted
        return slots.view(t, k, -1).sum(dim=1).to(x.dtype)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s output for its rows [n, H]: down(silu(gate) * up), [n, H]."""
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class ExpertLinears(Experts):
    """The routed experts of the fast path: expert e's projections are the linears `gate_up[e]`
    [2I, H] and `down[e]` [H, I], so that the fast path's replacement of linears gives each one the
    kernel for its dtype (models/packing.py `pack_linears`: oneDNN-prepacked bfloat16 where the CPU
    has bfloat16 kernels, which is bit-identical to `F.linear` on the stacked weight's slice;
    models/quantize.py `quantize_int8`: int8 with per-row scales). Routing and the weighted sum are
    `Experts.forward`'s."""

    def __init__(self, experts: Experts):
        nn.Module.__init__(self)
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        # views of the stacked weights (no copy): the stacked storage lives while any view does
        self.gate_up = nn.ModuleList(_view_linear(w) for w in experts.gate_up_proj.detach())
        self.down = nn.ModuleList(_view_linear(w) for w in experts.down_proj.detach())

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](rows).chunk(2, dim=-1)
        return self.down[e](F.silu(gate) * up)

    # Each expert's weight, indexed as `Experts`' stacked ones are (`gate_up_proj[e]` [2I, H]), where its
    # linears keep a plain weight (float32 and unpacked bfloat16); prepacked and int8 ones hold none.
    @property
    def gate_up_proj(self) -> tuple[torch.Tensor, ...]:
        return tuple(lin.weight for lin in self.gate_up)

    @property
    def down_proj(self) -> tuple[torch.Tensor, ...]:
        return tuple(lin.weight for lin in self.down)


def _view_linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear (no bias) whose weight is `weight` itself."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class SparseMoeBlock(nn.Module):
    """Router + routed experts + shared expert, under the names transformers gives them in memory:
    `gate`, `experts`, and `shared_expert` + `shared_expert_gate` (Qwen) or `shared_experts` (Kimi)."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert_gate: nn.Linear | None = None
        self._shared_name: str | None = None
        if cfg.shared_intermediate_size:
            self._shared_name = "shared_expert" if cfg.shared_gate else "shared_experts"
            self.add_module(self._shared_name, GatedMLP(cfg.hidden_size, cfg.shared_intermediate_size))
            if cfg.shared_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    @property
    def shared(self) -> GatedMLP | None:
        return None if self._shared_name is None else getattr(self, self._shared_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the post-attention norm's output of every token of the step) -> [T, H]."""
        out = self.experts(x, self.gate(x))
        shared = self.shared
        if shared is None:
            return out
        extra = shared(x)
        if self.shared_expert_gate is not None:
            extra = torch.sigmoid(self.shared_expert_gate(x)) * extra
        return out + extra


def split_experts(model: nn.Module) -> None:
    """Replace, in place, the stacked `Experts` of every MoE block of `model` by `ExpertLinears`
    (sharing the weights; blocks already split are left as they are)."""
    for module in list(model.modules()):
        if isinstance(module, SparseMoeBlock) and type(module.experts) is Experts:
            module.experts = ExpertLinears(module.experts)


@dataclass(frozen=True)
class ExpertNames:
    """The per-expert tensor names of a checkpoint family, under `<prefix>.<e>.`."""

    gate: str
    up: str
    down: str


QWEN_EXPERT_NAMES = ExpertNames("gate_proj", "up_proj", "down_proj")
KIMI_EXPERT_NAMES = ExpertNames("w1", "w3", "w2")


def fuse_expert_weights(
    state: dict[str, torch.Tensor], prefix: str, cfg: MoeConfig, names: ExpertNames
) -> None:
    """Bring one layer's experts in `state` to the fused layout, in place.

    `prefix` names the experts module ("model.layers.3.mlp.experts"). Accepted: the fused tensors
    `<prefix>.gate_up_proj` [E, 2I, H] and `<prefix>.down_proj` [E, H, I] (Qwen3.5-MoE releases), or one
    tensor per expert and projection `<prefix>.<e>.<name>.weight` (Qwen3-Next, Kimi, save_pretrained
    output), which are stacked into the fused pair. Raises UnsupportedModelError naming the tensor
    that is missing, of the wrong shape, of an expert index out of range, or given in both layouts.
    """
    e, i, h = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    fused_names = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
    dot = prefix + "."
    per_expert = sorted(key for key in state if key.startswith(dot) and key not in fused_names)
    present = [name for name in fused_names if name in state]
    if present and per_expert:
        raise UnsupportedModelError(
            f"experts given both fused ({present[0]}) and per expert ({per_expert[0]})"
        )
    if present:
        _check_shape(state, fused_names[0], (e, 2 * i, h))
        _check_shape(state, fused_names[1], (e, h, i))
        return
    expected = {
        f"{prefix}.{x}.{name}.weight": (x, part)
        for x in range(e)
        for part, name in enumerate((names.gate, names.up, names.down))
    }
    unknown = [key for key in per_expert if key not in expected]
    if unknown:
        raise UnsupportedModelError(
            f"unexpected expert tensor {unknown[0]} (experts 0..{e - 1}, names "
            f"{names.gate}/{names.up}/{names.down})"
        )
    for key, (_, part) in expected.items():
        _check_shape(state, key, (h, i) if part == 2 else (i, h))
    gate_up, down = [], []
    for x in range(e):
        g, u, d = (state.pop(f"{prefix}.{x}.{name}.weight") for name in (names.gate, names.up, names.down))
        gate_up.append(torch.cat((g, u), dim=0))
        down.append(d)
    state[fused_names[0]] = torch.stack(gate_up)
    state[fused_names[1]] = torch.stack(down)


def _check_shape(state: dict[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> None:
    tensor = state.get(key)
    if tensor is None:
        raise UnsupportedModelError(f"expert tensor {key} is missing")
    if tuple(tensor.shape) != shape:
        raise UnsupportedModelError(f"expert tensor {key} has shape {tuple(tensor.shape)}, expected {shape}")
