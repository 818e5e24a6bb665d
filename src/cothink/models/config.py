"""Model configuration: one frozen dataclass read from a Hugging Face checkpoint folder.

We let `transformers.AutoConfig` parse config.json (it knows every historical spelling of the
rope parameters) and keep only what the forward pass needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cothink.errors import UnsupportedModelError
from cothink.models.moe_config import (
    MOE_FAMILIES,
    FamilyConfig,
    KdaConfig,
    MlaConfig,
    family_config_from_hf,
    load_hf_family_config,
)

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# model_type -> our architecture family
_FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",  # Qwen2 and Qwen2.5: the Llama decoder with biases on q/k/v (none on o_proj)
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",  # multimodal layout; the text decoder sits under text_config
    "qwen3_5_text": "qwen3_5",
    "qwen3_vl": "qwen3",  # Qwen3-VL: the Qwen3 decoder (multimodal RoPE) under text_config, a vision tower
}
# multimodal layouts: the text decoder's config is the checkpoint's text_config
_MULTIMODAL = ("qwen3_5", "qwen3_vl")


@dataclass(frozen=True)
class GDNConfig:
    """Shapes of a Gated DeltaNet (linear attention) layer."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        # pre-conv channels are laid out [q | k | v]
        return 2 * self.key_dim + self.value_dim

    @property
    def decay_shape(self) -> tuple[int, ...]:
        """Shape of one token's log decay g (and of beta): one per value head."""
        return (self.num_v_heads,)

    def record_bytes(self, itemsize: int) -> int:
        """Bytes per token of one layer's replayable records: the pre-conv row in the model dtype,
        g and beta in fp32."""
        return self.conv_dim * itemsize + 2 * self.num_v_heads * 4


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen3.5 multimodal or Qwen3-VL checkpoint, and its placeholder token ids."""

    family: str  # "qwen3_5" | "qwen3_vl" (DeepStack)
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # = the text decoder's hidden size
    num_position_embeddings: int  # a square table of learned position embeddings
    hidden_act: str  # of the blocks' MLP (the merger's GELU is always erf)
    rope_theta: float
    deepstack_layers: tuple[int, ...]  # blocks whose output feeds a DeepStack merger (Qwen3-VL)
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one LLM token (merge x merge)."""
        return self.spatial_merge_size**2


# model_type of a multimodal checkpoint -> the family of its vision tower
_VISION_FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_vl": "qwen3_vl"}


def _single(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"vision {name} {value!r}: only square patches are supported")
        value = value[0]
    return int(value)


def vision_config_from_hf(hf: Any) -> VisionConfig | None:
    """The vision tower of a multimodal transformers config; None for text-only configs."""
    family = _VISION_FAMILIES.get(hf.model_type)
    vis = getattr(hf, "vision_config", None)
    if family is None or vis is None:
        return None
    rope = getattr(vis, "rope_parameters", None) or {}
    deepstack = (getattr(vis, "deepstack_visual_indexes", None) or ()) if family == "qwen3_vl" else ()
    return VisionConfig(
        family=family,
        depth=vis.depth,
        hidden_size=vis.hidden_size,
        intermediate_size=vis.intermediate_size,
        num_heads=vis.num_heads,
        in_channels=vis.in_channels,
        patch_size=_single(vis.patch_size, "patch_size"),
        temporal_patch_size=_single(vis.temporal_patch_size, "temporal_patch_size"),
        spatial_merge_size=vis.spatial_merge_size,
        out_hidden_size=vis.out_hidden_size,
        num_position_embeddings=vis.num_position_embeddings,
        hidden_act=vis.hidden_act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        deepstack_layers=tuple(deepstack),
        image_token_id=hf.image_token_id,
        video_token_id=hf.video_token_id,
        vision_start_token_id=hf.vision_start_token_id,
        vision_end_token_id=hf.vision_end_token_id,
    )


def load_vision_config(folder: str | Path) -> VisionConfig:
    """The vision tower's configuration of a local Qwen3.5 multimodal or Qwen3-VL checkpoint folder."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    vision = vision_config_from_hf(hf)
    if vision is None:
        raise UnsupportedModelError(
            f"model_type {hf.model_type!r} has no vision tower cothink runs ({sorted(_VISION_FAMILIES)})"
        )
    return vision


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the q/k/v projections
    o_proj_bias: bool  # a bias on the attention output projection (Llama's attention_bias; never Qwen2)
    mlp_bias: bool
    layer_types: tuple[str, ...]
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3.5)
    zero_centred_norm: bool  # RMSNorm computes x * (1 + w) (Qwen3.5)
    attn_output_gate: bool  # q_proj also yields a sigmoid gate per channel (Qwen3.5)
    gdn: GDNConfig | None
    eos_token_ids: tuple[int, ...]
    hf_text_config: Any  # the transformers config object of the text decoder (RoPE init reads it)
    vision: VisionConfig | None = None  # the vision tower of a multimodal checkpoint (models/vision.py)
    # the MoE / Kimi Linear extras (models/moe_config.py): sparse MLPs, KDA and MLA layers; None otherwise
    family_config: FamilyConfig | None = None

    @property
    def mla(self) -> MlaConfig | None:
        """Kimi's latent attention: its pool rows are one latent head of width head_dim (K = V)."""
        return None if self.family_config is None else self.family_config.mla

    @property
    def linear_config(self) -> GDNConfig | KdaConfig | None:
        """The state geometry of the linear-attention layers (Gated DeltaNet or KDA)."""
        if self.gdn is not None:
            return self.gdn
        return None if self.family_config is None else self.family_config.kda

    @property
    def attention_scale(self) -> float:
        if self.mla is not None:
            return self.mla.scale
        return self.head_dim**-0.5 if self.head_dim else 1.0  # (no attention layer: never used)

    @property
    def rotary_head_dim(self) -> int:
        """Channels of a stored key that RoPE may rotate: none for MLA (Kimi's attention is NoPE)."""
        return 0 if self.mla is not None else self.head_dim

    @property
    def shared_kv(self) -> bool:
        """Keys and values are one stored tensor (MLA's latent serves as both)."""
        return self.mla is not None

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV pool bytes of one token over all attention layers."""
        per_layer = (1 if self.shared_kv else 2) * self.num_kv_heads * self.head_dim * itemsize
        return len(self.attention_layers) * per_layer

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]


def _eos_ids(cfg: Any) -> tuple[int, ...]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def load_config(folder: str | Path) -> ModelConfig:
    """Read config.json of a local checkpoint folder into a ModelConfig."""
    from transformers import AutoConfig

    raw = json.loads((Path(folder) / "config.json").read_text())
    if raw.get("model_type") in MOE_FAMILIES:
        return family_model_config(load_hf_family_config(folder))
    hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    family = _FAMILIES.get(hf.model_type)
    if family is None:
        supported = sorted({*_FAMILIES, *MOE_FAMILIES})
        raise UnsupportedModelError(
            f"model_type {hf.model_type!r} is not supported; cothink runs {supported}"
        )
    text = hf.get_text_config() if hf.model_type in _MULTIMODAL else hf
    cfg = config_from_hf(text, family, eos=_eos_ids(hf) or _eos_ids(text))
    vision = vision_config_from_hf(hf)
    return cfg if vision is None else replace(cfg, vision=vision)


def config_from_hf(text: Any, family: str, eos: tuple[int, ...] = ()) -> ModelConfig:
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    layer_types = tuple(getattr(text, "layer_types", None) or [FULL_ATTENTION] * text.num_hidden_layers)
    unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    if getattr(text, "use_sliding_window", False):
        raise UnsupportedModelError("sliding-window attention is not supported")
    rope_type = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} depends on sequence length; views need static RoPE"
        )
    gdn = None
    if LINEAR_ATTENTION in layer_types:
        gdn = GDNConfig(
            num_k_heads=text.linear_num_key_heads,
            num_v_heads=text.linear_num_value_heads,
            k_dim=text.linear_key_head_dim,
            v_dim=text.linear_value_head_dim,
            conv_kernel=text.linear_conv_kernel_dim,
        )
    qwen35 = family == "qwen3_5"
    # Qwen2's config has no attention_bias: its q/k/v projections always carry one, its o_proj never
    qkv_bias = family == "qwen2" or bool(getattr(text, "attention_bias", False))
    return ModelConfig(
        family=family,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=text.rms_norm_eps,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=family != "qwen2" and qkv_bias,
        mlp_bias=bool(getattr(text, "mlp_bias", False)),
        layer_types=layer_types,
        qk_norm=family in ("qwen3", "qwen3_5"),
        zero_centred_norm=qwen35,
        attn_output_gate=qwen35,
        gdn=gdn,
        eos_token_ids=eos or _eos_ids(text),
        hf_text_config=text,
    )


def family_model_config(hf: Any) -> ModelConfig:
    """The ModelConfig of a Qwen3.5-MoE (text or multimodal layout), Qwen3-Next or Kimi Linear config.

    Qwen3.5-MoE and Qwen3-Next share Qwen3.5's attention (q/k norm, output gate, zero-centred norms,
    partial RoPE) and Gated DeltaNet; their MLPs are sparse MoE blocks where `family_config` says so.
    Kimi Linear's attention layers are MLA, whose pool rows are one latent head of width r + dr
    (`num_kv_heads` 1, `head_dim` r + dr, K = V, no RoPE); its linear layers are KDA."""
    fam = family_config_from_hf(hf)
    text = hf.get_text_config() if hf.model_type == "qwen3_5_moe" else hf
    eos = _eos_ids(hf) or _eos_ids(text)
    common = dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=fam.dense_intermediate_size or 0,
        num_layers=len(fam.layer_types),
        rms_norm_eps=text.rms_norm_eps,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        mlp_bias=False,
        layer_types=fam.layer_types,
        eos_token_ids=eos,
        hf_text_config=text,
        family_config=fam,
    )
    if fam.family == "kimi_linear":
        mla = fam.mla
        return ModelConfig(
            family=fam.family,
            num_heads=mla.num_heads if mla is not None else text.num_attention_heads,
            num_kv_heads=1,
            head_dim=mla.latent_dim if mla is not None else 0,
            attention_bias=False,
            o_proj_bias=False,
            qk_norm=False,
            zero_centred_norm=False,
            attn_output_gate=False,
            gdn=None,
            **common,
        )
    rope_type = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} depends on sequence length; views need static RoPE"
        )
    gdn = None
    if LINEAR_ATTENTION in fam.layer_types:
        gdn = GDNConfig(
            num_k_heads=text.linear_num_key_heads,
            num_v_heads=text.linear_num_value_heads,
            k_dim=text.linear_key_head_dim,
            v_dim=text.linear_value_head_dim,
            conv_kernel=text.linear_conv_kernel_dim,
        )
    bias = bool(getattr(text, "attention_bias", False))
    return ModelConfig(
        family=fam.family,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        zero_centred_norm=True,
        attn_output_gate=True,
        gdn=gdn,
        **common,
    )
