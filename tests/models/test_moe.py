"""cothink.models.moe against transformers' MoE blocks (Qwen3.5-MoE, Qwen3-Next, Kimi Linear) on tiny random
configs with every parameter and buffer randomised, plus batch routing and the expert-weight loader."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from support import tiny_hybrid_moe, tiny_kimi_config

from cothink.errors import UnsupportedModelError
from cothink.models.moe import (
    KIMI_EXPERT_NAMES,
    QWEN_EXPERT_NAMES,
    SparseMoeBlock,
    fuse_expert_weights,
)
from cothink.models.moe_config import family_config_from_hf

H = 32


def _qwen35(**kw):
    return tf.Qwen3_5MoeTextConfig(**tiny_hybrid_moe(**(dict(num_experts_per_tok=8) | kw)))


def _next(**kw):
    extra = dict(
        intermediate_size=24,
        num_experts_per_tok=6,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    return tf.Qwen3NextConfig(**tiny_hybrid_moe(**(extra | kw)))


def _kimi(**kw):
    extra = dict(
        num_local_experts=16,
        num_experts_per_tok=5,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
    )
    return tiny_kimi_config(**(extra | kw))


def _reference_block(hf_cfg, implementation: str):
    hf_cfg._experts_implementation = implementation
    if isinstance(hf_cfg, tf.KimiLinearConfig):
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

        return KimiLinearMoE(hf_cfg)
    if isinstance(hf_cfg, tf.Qwen3NextConfig):
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

        return Qwen3NextSparseMoeBlock(hf_cfg)
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    return Qwen3_5MoeSparseMoeBlock(hf_cfg)


def _randomised(hf_cfg, seed: int) -> SparseMoeBlock:
    """Our block with every parameter and buffer random (routers, correction bias, shared gate included)."""
    block = SparseMoeBlock(family_config_from_hf(hf_cfg).moe)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            scale = 0.3 if "correction" in name else (0.4 if name.startswith("gate") else 0.25)
            t.copy_(scale * torch.randn(t.shape, generator=gen))
    return block


def _pair(hf_cfg, seed: int, implementation: str = "grouped_mm", dtype=torch.float32):
    ours = _randomised(hf_cfg, seed)
    ref = _reference_block(hf_cfg, implementation)
    ref.load_state_dict(ours.state_dict(), strict=True)  # the names are transformers' in-memory names
    return ours.to(dtype).eval(), ref.to(dtype).eval()


CONFIGS = {
    "qwen3_5_moe": lambda: _qwen35(),
    "qwen3_next": lambda: _next(),
    "qwen3_next_nonorm": lambda: _next(norm_topk_prob=False),
    "kimi": lambda: _kimi(),
    "kimi_grouped": lambda: _kimi(n_group=4, topk_group=2, num_experts_per_tok=6),
}


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_block_equals_transformers_fp32(name, implementation):
    """fp32: our block equals transformers' block (both of its experts paths) on random rows."""
    ours, ref = _pair(CONFIGS[name](), seed=len(name))
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(x)
        want = ref(x[None])[0]
        routing, ref_routing = ours.gate(x), ref.gate(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(routing.experts.sort(-1)[0], ref_routing[2].sort(-1)[0])  # the same expert sets
    assert got.abs().max() > 0.1  # the experts contribute


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_block_equals_transformers_grouped_mm_bf16(name):
    """bfloat16: the same dtype chain as transformers' grouped_mm path, to the bit."""
    ours, ref = _pair(CONFIGS[name](), seed=3 + len(name), dtype=torch.bfloat16)
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        got, want = ours(x), ref(x[None])[0]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_router_ties_pick_torch_topk_order():
    """Quantised logits tie many experts: our selection is transformers' (torch.topk's tie order)."""
    hf_cfg = _qwen35()
    ours, ref = _pair(hf_cfg, seed=5)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours.gate.weight.copy_((ours.gate.weight * 4).round() / 4)
        ref.gate.weight.copy_(ours.gate.weight)
        x = (x * 2).round() / 2
        got, want = ours.gate(x), ref.gate(x)
    assert torch.equal(got.experts, want[2])
    torch.testing.assert_close(got.weights, want[1], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "kimi_grouped"])
def test_batch_routing_equals_each_row_alone(name):
    """Rows of several coroutines routed in one step give what each row gives alone: fp32 to rounding
    (the router and expert GEMMs see other row counts), with the same experts selected."""
    ours, _ = _pair(CONFIGS[name](), seed=11)
    gen = torch.Generator().manual_seed(6)
    items = [torch.randn(n, H, generator=gen) for n in (1, 5, 1, 12, 3)]  # decodes and prefill chunks
    with torch.no_grad():
        together = ours(torch.cat(items))
        alone = torch.cat([ours(item) for item in items])
        rows = torch.cat([ours(row[None]) for row in torch.cat(items)])
        sel_together = ours.gate(torch.cat(items)).experts.sort(-1)[0]
        sel_alone = torch.cat([ours.gate(row[None]).experts for row in torch.cat(items)]).sort(-1)[0]
    assert torch.equal(sel_together, sel_alone)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(together, rows, atol=1e-5, rtol=0)


def test_batch_routing_bf16_close():
    """bfloat16: a row's router logits may differ by one rounding between batchings (the documented caveat);
    on these rows no selection flips and the outputs agree to bfloat16 rounding."""
    ours, _ = _pair(CONFIGS["qwen3_next"](), seed=12, dtype=torch.bfloat16)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        together = ours(x).float()
        alone = torch.cat([ours(row[None]) for row in x]).float()
    torch.testing.assert_close(together, alone, atol=2e-2, rtol=2e-2)


def _per_expert_state(block: SparseMoeBlock, names) -> dict[str, torch.Tensor]:
    """The block's state with its experts written one tensor per expert and projection (checkpoint layout)."""
    state = {k: v.clone() for k, v in block.state_dict().items() if not k.startswith("experts.")}
    i = block.cfg.intermediate_size
    for e in range(block.cfg.num_experts):
        gate_up = block.experts.gate_up_proj[e]
        state[f"experts.{e}.{names.gate}.weight"] = gate_up[:i].clone()
        state[f"experts.{e}.{names.up}.weight"] = gate_up[i:].clone()
        state[f"experts.{e}.{names.down}.weight"] = block.experts.down_proj[e].clone()
    return state


@pytest.mark.parametrize("name,names", [("qwen3_next", QWEN_EXPERT_NAMES), ("kimi", KIMI_EXPERT_NAMES)])
def test_fused_and_per_expert_layouts_load_equal_modules(name, names):
    hf_cfg = CONFIGS[name]()
    block = _randomised(hf_cfg, seed=21)
    cfg = block.cfg
    per_expert = _per_expert_state(block, names)
    fuse_expert_weights(per_expert, "experts", cfg, names)
    fused = {k: v.clone() for k, v in block.state_dict().items()}
    fuse_expert_weights(fused, "experts", cfg, names)  # already fused: checked, unchanged
    a, b = SparseMoeBlock(cfg), SparseMoeBlock(cfg)
    a.load_state_dict(per_expert, strict=True)
    b.load_state_dict(fused, strict=True)
    for (ka, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(ta, tb), ka
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_loader_errors_name_the_tensor():
    hf_cfg = _next()
    block = _randomised(hf_cfg, seed=22)
    cfg = block.cfg

    def fresh():
        return _per_expert_state(block, QWEN_EXPERT_NAMES)

    state = fresh()
    del state["experts.7.up_proj.weight"]
    with pytest.raises(UnsupportedModelError, match=r"experts\.7\.up_proj\.weight is missing"):
        fuse_expert_weights(state, "experts", cfg, QWEN_EXPERT_NAMES)
    state = fresh()
    state["experts.3.down_proj.weight"] = state["experts.3.down_proj.weight"][:, :-1]
    with pytest.raises(UnsupportedModelError, match=r"experts\.3\.down_proj\.weight has shape"):
        fuse_expert_weights(state, "experts", cfg, QWEN_EXPERT_NAMES)
    state = fresh()
    state["experts.16.gate_proj.weight"] = state["experts.0.gate_proj.weight"]
    with pytest.raises(
        UnsupportedModelError, match=r"unexpected expert tensor experts\.16\.gate_proj\.weight"
    ):
        fuse_expert_weights(state, "experts", cfg, QWEN_EXPERT_NAMES)
    state = fresh()
    state["experts.down_proj"] = block.experts.down_proj.detach()
    with pytest.raises(UnsupportedModelError, match="both fused"):
        fuse_expert_weights(state, "experts", cfg, QWEN_EXPERT_NAMES)
    state = {k: v for k, v in block.state_dict().items()}
    state["experts.gate_up_proj"] = state["experts.gate_up_proj"][:-1]
    with pytest.raises(UnsupportedModelError, match=r"experts\.gate_up_proj has shape"):
        fuse_expert_weights(state, "experts", cfg, QWEN_EXPERT_NAMES)
    state = {k: v for k, v in block.state_dict().items() if k != "experts.down_proj"}
    with pytest.raises(UnsupportedModelError, match=r"experts\.down_proj is missing"):
        fuse_expert_weights(state, "experts", cfg, QWEN_EXPERT_NAMES)


def test_empty_step():
    ours, _ = _pair(CONFIGS["kimi"](), seed=1)
    with torch.no_grad():
        assert ours(torch.empty(0, H)).shape == (0, H)
