"""Loading the MoE and Kimi Linear families: every checkpoint layout gives the same model, and a checkpoint
or config cothink cannot run fails at load with a typed error naming the tensor or the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import max_err, random_ids
from safetensors.torch import load_file, save_file

import cothink
from cothink.errors import UnsupportedModelError


def _copy(tiny_model, name: str, tmp_path: Path) -> Path:
    folder = tmp_path / name
    shutil.copytree(tiny_model(name).folder, folder)
    return folder


def _rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _same_model(a: cothink.ModelRunner, b: cothink.ModelRunner) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    ids = random_ids(20, seed=3)
    assert torch.equal(a.extend(a.new_block(), ids), b.extend(b.new_block(), ids))


def _fuse_experts(state: dict[str, torch.Tensor]) -> None:
    layers = sorted({k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k})
    for p in layers:
        n = len({k for k in state if k.startswith(f"{p}.mlp.experts.") and k.endswith("down_proj.weight")})
        parts = [[state.pop(f"{p}.mlp.experts.{e}.{x}_proj.weight") for x in ("gate", "up", "down")]
                 for e in range(n)]
        state[f"{p}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u, _ in parts])
        state[f"{p}.mlp.experts.down_proj"] = torch.stack([d for _, _, d in parts])


def test_fused_and_per_expert_layouts_load_equal(tiny_model, tmp_path):
    per_expert = tiny_model("qwen35_moe").runner()
    folder = _copy(tiny_model, "qwen35_moe", tmp_path)
    _rewrite(folder, _fuse_experts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(folder / "model.safetensors"))
    _same_model(per_expert, cothink.load_model(folder))


def test_qwen3_next_grouped_and_split_projections_load_equal(tiny_model, tmp_path):
    """Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba and the Qwen3.5 layout load to the same bits."""
    grouped = tiny_model("qwen3_next").runner()
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in load_file(
        str(tiny_model("qwen3_next").folder / "model.safetensors"))
    folder = _copy(tiny_model, "qwen3_next", tmp_path)
    params = grouped.model.state_dict()

    def split(state):
        for key in [k for k in state if "in_proj_qkvz" in k or "in_proj_ba" in k]:
            del state[key]
        for key, value in params.items():
            if any(f".{x}.weight" in key for x in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
                state[key] = value.contiguous()

    _rewrite(folder, split)
    _same_model(grouped, cothink.load_model(folder))


def test_kimi_forget_gate_spelling_loads_equal(tiny_model, tmp_path):
    """transformers holds KDA's f_a_proj, f_b_proj, dt_bias and A_log under `forget_gate.`: both load."""
    plain = tiny_model("kimi").runner()
    folder = _copy(tiny_model, "kimi", tmp_path)

    def nest(state):
        for key in [k for k in state if k.split(".")[-2] in ("f_a_proj", "f_b_proj")
                    or k.endswith((".dt_bias", ".A_log"))]:
            state[key.replace(".self_attn.", ".self_attn.forget_gate.")] = state.pop(key)

    _rewrite(folder, nest)
    _same_model(plain, cothink.load_model(folder))


def test_multimodal_moe_layout_skips_visual_and_mtp(tiny_model):
    state = load_file(str(tiny_model("qwen35_moe_mm").folder / "model.safetensors"))
    assert any(k.startswith("mtp.") for k in state) and any(k.startswith("model.visual.") for k in state)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in state  # fused on disk
    runner = tiny_model("qwen35_moe_mm").runner()
    assert runner.config.family == "qwen3_5_moe" and runner.config.vision is None


# ---- refusals ----------------------------------------------------------------------------------------
def _refused(folder: Path, match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        cothink.load_model(folder)


def test_missing_expert_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "qwen35_moe", tmp_path)
    _rewrite(folder, lambda s: s.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    _refused(folder, r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight is missing")


def test_misshapen_expert_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "kimi", tmp_path)
    key = "model.layers.2.block_sparse_moe.experts.5.w2.weight"

    def shrink(state):
        state[key] = state[key][:, :-1].contiguous()

    _rewrite(folder, shrink)
    _refused(folder, rf"{key.replace('.', '[.]')} has shape \(64, 23\), expected \(64, 24\)")


def test_expert_out_of_range_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "qwen3_next", tmp_path)

    def extra(state):
        state["model.layers.0.mlp.experts.16.gate_proj.weight"] = torch.zeros(24, 64)

    _rewrite(folder, extra)
    _refused(folder, r"unexpected expert tensor model\.layers\.0\.mlp\.experts\.16\.gate_proj\.weight")


def test_fused_experts_of_the_wrong_shape_are_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "qwen35_moe_mm", tmp_path)
    key = "model.language_model.layers.2.mlp.experts.down_proj"
    _rewrite(folder, lambda s: s.__setitem__(key, s[key][:8].contiguous()))
    _refused(folder, r"model\.layers\.2\.mlp\.experts\.down_proj has shape \(8, 64, 24\)")


def test_missing_kda_conv_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "kimi", tmp_path)
    _rewrite(folder, lambda s: s.pop("model.layers.1.self_attn.k_conv1d.weight"))
    _refused(folder, r"model\.layers\.1\.self_attn\.k_conv1d\.weight is missing")


def test_missing_router_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "kimi", tmp_path)
    _rewrite(folder, lambda s: s.pop("model.layers.1.block_sparse_moe.gate.e_score_correction_bias"))
    _refused(folder, r"missing \['model\.layers\.1\.mlp\.gate\.e_score_correction_bias'\]")


def test_unsupported_layer_type_is_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, "qwen3_next", tmp_path)
    _edit_config(folder, lambda raw: raw.__setitem__("layer_types", ["linear_attention", "sliding_attention",
                                                                     "linear_attention"]))
    _refused(folder, "layer_types")


def test_kimi_layer_lists_are_checked(tiny_model, tmp_path):
    """The checkpoint's 1-based linear_attn_config lists must name every layer once."""
    folder = _copy(tiny_model, "kimi", tmp_path)

    def lists(raw):
        raw.pop("layer_types", None)
        raw["linear_attn_config"] = {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                                     "kda_layers": [1, 2], "full_attn_layers": [2]}

    _edit_config(folder, lists)
    _refused(folder, r"linear_attn_config\.full_attn_layers.*names layer 2, already in")


def test_kimi_one_based_layer_lists_load(tiny_model, tmp_path):
    folder = _copy(tiny_model, "kimi", tmp_path)

    def lists(raw):
        raw.pop("layer_types", None)
        raw["linear_attn_config"] = {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                                     "kda_layers": [1, 2], "full_attn_layers": [3]}

    _edit_config(folder, lists)
    runner = cothink.load_model(folder)
    assert runner.config.layer_types == ("linear_attention", "linear_attention", "full_attention")
    _same_model(tiny_model("kimi").runner(), runner)


def test_mla_with_rope_is_refused(tiny_model, tmp_path):
    folder = _copy(tiny_model, "kimi", tmp_path)
    _edit_config(folder, lambda raw: raw.__setitem__("mla_use_nope", False))
    _refused(folder, "mla_use_nope")


def test_engine_from_pretrained_sizes_the_pool_from_the_latent(tiny_model):
    """Kimi's pool holds one latent row per MLA layer and token: the budget buys that many tokens."""
    engine = cothink.Engine.from_pretrained(tiny_model("kimi").folder, memory_budget="1MiB")
    mem = engine.memory()
    cfg = engine.runner.config
    assert mem.kv_bytes_per_token == (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4
    assert mem.total_pages * mem.page_bytes >= 2**20 - mem.page_bytes


def test_moe_family_config_fields(tiny_model):
    cfg = tiny_model("qwen3_next").runner().config
    fam = cfg.family_config
    assert fam.sparse_layers == (True, False, True) and fam.dense_intermediate_size == 48
    assert fam.moe.norm_topk_prob and fam.moe.top_k == 4 and cfg.rotary_head_dim == cfg.head_dim
    kimi = tiny_model("kimi").runner().config
    assert kimi.rotary_head_dim == 0 and kimi.num_kv_heads == 1 and kimi.shared_kv
    assert kimi.family_config.sparse_layers == (False, True, True)
    assert max_err(torch.tensor(kimi.attention_scale), torch.tensor((12 + 8) ** -0.5)) == 0
