"""cothink.models.moe_config: Qwen3.5-MoE (text and multimodal nesting), Qwen3-Next and Kimi Linear configs
read from config.json folders, the typed refusals naming the field, and Qwen3-Next's projection layout
(cothink.models.hybrid_weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from support import tiny_hybrid_moe
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from cothink.errors import UnsupportedModelError
from cothink.models.config import GDNConfig
from cothink.models.hybrid_weights import split_qwen3_next_projections
from cothink.models.moe_config import family_config_from_hf, load_family_config

L, F = "linear_attention", "full_attention"

QWEN35_TEXT = tiny_hybrid_moe(
    num_hidden_layers=3, layer_types=[L, F, L], shared_expert_intermediate_size=24, num_experts_per_tok=8
)

KIMI_RAW = {
    "model_type": "kimi_linear",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "num_expert_group": 2,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid",
    "rms_norm_eps": 1e-5,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "linear_attn_config": {
        "head_dim": 8,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5],
        "full_attn_layers": [4],
    },
}


def _folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _saved(tmp_path: Path, hf_cfg) -> Path:
    hf_cfg.save_pretrained(tmp_path)
    return tmp_path


def test_qwen35_moe_text_and_multimodal_nesting(tmp_path):
    text = tf.Qwen3_5MoeTextConfig(**QWEN35_TEXT)
    with pytest.raises(AttributeError):
        text.intermediate_size  # noqa: B018  (the trap: the MoE text config has none)
    mm = tf.Qwen3_5MoeConfig(
        text_config=text.to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32),
    )
    for folder in (_saved(tmp_path / "text", text), _saved(tmp_path / "mm", mm)):
        fam = load_family_config(folder)
        assert fam.family == "qwen3_5_moe" and fam.layer_types == (L, F, L)
        assert fam.sparse_layers == (True, True, True) and fam.dense_intermediate_size is None
        m = fam.moe
        assert (m.num_experts, m.top_k, m.intermediate_size, m.shared_intermediate_size) == (16, 8, 16, 24)
        assert m.router == "softmax" and m.norm_topk_prob and m.shared_gate and not m.correction_bias
        assert fam.kda is None and fam.mla is None


def test_qwen3_next_sparse_step_and_dense_layers(tmp_path):
    cfg = tf.Qwen3NextConfig(
        **{k: v for k, v in QWEN35_TEXT.items()},
        intermediate_size=40,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    )
    fam = load_family_config(_saved(tmp_path, cfg))
    assert fam.family == "qwen3_next" and fam.sparse_layers == (True, False, True)
    assert fam.dense_intermediate_size == 40 and fam.moe_layers == [0, 2]
    assert not fam.moe.norm_topk_prob and fam.moe.shared_gate
    cfg = tf.Qwen3NextConfig(
        **{**QWEN35_TEXT, "num_hidden_layers": 4, "layer_types": [L, L, L, F]},
        intermediate_size=40,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    )
    fam = family_config_from_hf(cfg)
    assert fam.sparse_layers == (False, True, False, True) and fam.moe.norm_topk_prob


def test_kimi_one_based_lists_aliases_and_head_dim_trap(tmp_path):
    fam = load_family_config(_folder(tmp_path, KIMI_RAW))
    assert fam.family == "kimi_linear"
    assert fam.layer_types == (L, L, L, F, L)  # full_attn_layers [4] is 1-based: layer 3
    assert fam.sparse_layers == (False, True, True, True, True) and fam.dense_intermediate_size == 48
    m = fam.moe
    assert (m.num_experts, m.top_k, m.num_groups, m.topk_group) == (
        8,
        4,
        2,
        1,
    )  # from the checkpoint's aliases
    assert m.router == "sigmoid" and m.correction_bias and not m.shared_gate and m.norm_topk_prob
    assert m.shared_intermediate_size == 16 and m.routed_scaling_factor == pytest.approx(2.446)
    assert (fam.kda.num_heads, fam.kda.head_dim, fam.kda.conv_kernel, fam.kda.norm_eps) == (4, 8, 4, 1e-5)
    mla = fam.mla  # transformers' config.head_dim is the rope dim (8); the MLA fields are read instead
    assert (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (16, 12, 8, 10)
    assert mla.latent_dim == 24 and mla.scale == pytest.approx(20**-0.5)


@pytest.mark.parametrize(
    "change,field",
    [
        (
            {"linear_attn_config": {**KIMI_RAW["linear_attn_config"], "kda_layers": [1, 2, 3]}},
            r"do not name layers \[5\]",
        ),
        (
            {"linear_attn_config": {**KIMI_RAW["linear_attn_config"], "kda_layers": [0, 1, 2, 3, 5]}},
            r"'linear_attn_config.kda_layers' names layer 0",
        ),
        (
            {"linear_attn_config": {**KIMI_RAW["linear_attn_config"], "full_attn_layers": [4, 5]}},
            r"'linear_attn_config.full_attn_layers' names layer 5, already",
        ),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_kimi_refusals_name_the_field(tmp_path, change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        load_family_config(_folder(tmp_path, {**KIMI_RAW, **change}))


def test_unsupported_layer_type_and_model_type(tmp_path):
    cfg = tf.Qwen3NextConfig(
        **{**QWEN35_TEXT, "layer_types": [L, "sliding_attention", L]}, intermediate_size=40
    )
    with pytest.raises(UnsupportedModelError, match=r"'layer_types\[1\]' is 'sliding_attention'"):
        family_config_from_hf(cfg)
    with pytest.raises(UnsupportedModelError, match="'mlp_only_layers' names layers"):
        family_config_from_hf(tf.Qwen3NextConfig(**QWEN35_TEXT, intermediate_size=40, mlp_only_layers=[7]))
    with pytest.raises(UnsupportedModelError, match="model_type 'llama'"):
        family_config_from_hf(tf.LlamaConfig())
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok 20"):
        family_config_from_hf(tf.Qwen3_5MoeTextConfig(**{**QWEN35_TEXT, "num_experts_per_tok": 20}))


def test_qwen3_next_projections_map_onto_the_qwen35_layout_bitwise():
    """Qwen3-Next's per-key-head qkvz/ba projections, permuted into the Qwen3.5 layout, give a Qwen3.5 Gated
    DeltaNet layer whose output equals Qwen3-Next's to the bit."""
    nxt = Qwen3NextGatedDeltaNet(tf.Qwen3NextConfig(**QWEN35_TEXT, intermediate_size=40), 0).eval()
    q35 = Qwen3_5MoeGatedDeltaNet(tf.Qwen3_5MoeTextConfig(**QWEN35_TEXT), 0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in nxt.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    gdn = GDNConfig(num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=8, conv_kernel=4)
    state = {f"m.{k}": v.clone() for k, v in nxt.state_dict().items()}
    split_qwen3_next_projections(state, "m", gdn)
    q35.load_state_dict({k[2:]: v for k, v in state.items()}, strict=True)
    x = torch.randn(1, 11, 32, generator=gen)
    with torch.no_grad():
        assert torch.equal(q35(x), nxt(x))
    state = {f"m.{k}": v.clone() for k, v in nxt.state_dict().items() if "in_proj_ba" not in k}
    with pytest.raises(UnsupportedModelError, match=r"m\.in_proj_ba\.weight is missing"):
        split_qwen3_next_projections(state, "m", gdn)
