"""Configuration of the mixture-of-experts and Kimi Linear families, read from transformers configs.

Three families: `qwen3_5_moe` (Qwen3.5-MoE: nested under `text_config` in the multimodal layout,
flat as `qwen3_5_moe_text`; every layer's MLP is a sparse MoE block), `qwen3_next` (flat; a layer is
sparse iff it is not in `mlp_only_layers` and `(layer + 1) % decoder_sparse_step == 0`) and
`kimi_linear` (flat; KDA and MLA token mixers, `mlp_layer_types` "dense"/"sparse"; the checkpoint's
`linear_attn_config` gives 1-based layer lists, which transformers' config turns into 0-based
`layer_types`). The records here hold what cothink's modules need (models/moe.py, models/kda.py,
models/mla.py); each refusal is an UnsupportedModelError naming the config field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cothink.errors import UnsupportedModelError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# model_type -> family
MOE_FAMILIES = {
    "qwen3_5_moe": "qwen3_5_moe",  # multimodal layout: the text decoder sits under text_config
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "kimi_linear": "kimi_linear",
}

# Kimi's MLA keys: the latent normalisations use the RMSNorm's default eps, not rms_norm_eps
MLA_LATENT_NORM_EPS = 1e-6

Router = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MoE block: routed experts of `intermediate_size`, optional shared expert."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    shared_intermediate_size: int  # of the shared expert (0: none)
    shared_gate: bool  # the shared expert's output is scaled by sigmoid(Linear(hidden -> 1)) (Qwen)
    router: Router  # "softmax": model-dtype logits, fp32 softmax (Qwen); "sigmoid": fp32 throughout (Kimi)
    norm_topk_prob: bool  # renormalise the k selected weights to sum 1
    routed_scaling_factor: float  # routed weights are multiplied by this (Kimi; 1.0 for Qwen)
    num_groups: int  # expert groups of the group-limited selection (Kimi's n_group)
    topk_group: int  # groups a token may select experts from
    correction_bias: bool  # e_score_correction_bias added to the scores for selection only (Kimi)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok {self.top_k} with {self.num_experts} experts")
        if self.num_experts % self.num_groups or not 0 < self.topk_group <= self.num_groups:
            raise UnsupportedModelError(
                f"n_group {self.num_groups} / topk_group {self.topk_group} with {self.num_experts} experts"
            )
        if self.num_groups > 1 and self.top_k > self.topk_group * (self.num_experts // self.num_groups):
            raise UnsupportedModelError("num_experts_per_tok exceeds the experts of the selectable groups")


@dataclass(frozen=True)
class KdaConfig:
    """A Kimi Delta Attention layer: H heads with K = V = head_dim (no grouped heads)."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    norm_eps: float  # of the gated output norm (rms_norm_eps)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        # pre-conv channels are laid out [q | k | v]
        return 3 * self.key_dim

    # the state geometry under GDNConfig's names (state [num_v_heads, k_dim, v_dim], conv tail
    # [conv_kernel - 1, conv_dim]), so code over a linear layer's state reads both alike
    @property
    def num_v_heads(self) -> int:
        return self.num_heads

    @property
    def k_dim(self) -> int:
        return self.head_dim

    @property
    def v_dim(self) -> int:
        return self.head_dim

    @property
    def decay_shape(self) -> tuple[int, ...]:
        """Shape of one token's log decay g: one per key channel of each head."""
        return (self.num_heads, self.head_dim)

    def record_bytes(self, itemsize: int) -> int:
        """Bytes per token of one layer's replayable records: pre-conv rows in the model dtype, the
        per-channel log decay g [H, K] and beta [H] in fp32."""
        return self.conv_dim * itemsize + (self.key_dim + self.num_heads) * 4

    @property
    def summary_bytes(self) -> int:
        """Bytes of one layer's dense block summary [B | A], [H, K, 2K] fp32."""
        return self.num_heads * self.head_dim * 2 * self.head_dim * 4


@dataclass(frozen=True)
class MlaConfig:
    """Kimi's multi-head latent attention without RoPE (NoPE: no rotation anywhere)."""

    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int  # r: the normalised latent c
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr: the key part shared by all heads (never rotated here)
    v_head_dim: int  # dv
    bias: bool  # on kv_a_proj_with_mqa, q_a_proj and o_proj (attention_bias)

    @property
    def latent_dim(self) -> int:
        """Values stored per token and layer: [c | k_rope], r + dr."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def latent_bytes(self, itemsize: int) -> int:
        """Bytes per token of one MLA layer's cache (the latent, not the expanded keys and values)."""
        return self.latent_dim * itemsize


@dataclass(frozen=True)
class FamilyConfig:
    """What the MoE and Kimi Linear families add to a decoder's configuration."""

    family: str  # "qwen3_5_moe" | "qwen3_next" | "kimi_linear"
    layer_types: tuple[str, ...]  # "full_attention" (attention; MLA for Kimi) | "linear_attention" (GDN; KDA)
    sparse_layers: tuple[bool, ...]  # per layer: a sparse MoE block (True) or a dense MLP
    dense_intermediate_size: int | None  # of the dense MLP layers (None: there are none)
    moe: MoeConfig
    kda: KdaConfig | None  # Kimi Linear's linear-attention layers
    mla: MlaConfig | None  # Kimi Linear's attention layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]


def _field(cfg: Any, name: str) -> Any:
    """A config attribute, with a typed error naming it when the config lacks it (Qwen3.5-MoE's text
    config raises AttributeError on fields it deletes, such as intermediate_size)."""
    try:
        return getattr(cfg, name)
    except AttributeError:
        raise UnsupportedModelError(f"config field {name!r} is missing") from None


def _layer_types(text: Any) -> tuple[str, ...]:
    n = _field(text, "num_hidden_layers")
    types = getattr(text, "layer_types", None)
    if types is None or len(types) != n:
        raise UnsupportedModelError(f"config field 'layer_types' must list {n} layers, got {types!r}")
    for i, kind in enumerate(types):
        if kind not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise UnsupportedModelError(
                f"config field 'layer_types[{i}]' is {kind!r}; supported: "
                f"{FULL_ATTENTION!r}, {LINEAR_ATTENTION!r}"
            )
    return tuple(types)


def _check_silu(text: Any) -> None:
    act = getattr(text, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config field 'hidden_act' is {act!r}; the experts run SiLU")


def _qwen_moe(text: Any, norm_topk_prob: bool) -> MoeConfig:
    return MoeConfig(
        hidden_size=_field(text, "hidden_size"),
        num_experts=_field(text, "num_experts"),
        top_k=_field(text, "num_experts_per_tok"),
        intermediate_size=_field(text, "moe_intermediate_size"),
        shared_intermediate_size=_field(text, "shared_expert_intermediate_size"),
        shared_gate=True,
        router="softmax",
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=1.0,
        num_groups=1,
        topk_group=1,
        correction_bias=False,
    )


def family_config_from_hf(hf: Any) -> FamilyConfig:
    """The family extras of a transformers config (the multimodal Qwen3.5-MoE wrapper or its text
    config, Qwen3-Next, Kimi Linear)."""
    family = MOE_FAMILIES.get(getattr(hf, "model_type", None))
    if family is None:
        raise UnsupportedModelError(
            f"model_type {getattr(hf, 'model_type', None)!r} is not one of {sorted(MOE_FAMILIES)}"
        )
    text = hf.get_text_config() if family == "qwen3_5_moe" else hf
    _check_silu(text)
    layer_types = _layer_types(text)
    n = len(layer_types)
    if family == "qwen3_5_moe":
        # no norm_topk_prob field: the top-k weights are always renormalised; every MLP is sparse
        return FamilyConfig(family, layer_types, (True,) * n, None, _qwen_moe(text, True), None, None)
    if family == "qwen3_next":
        step = _field(text, "decoder_sparse_step")
        only_dense = set(getattr(text, "mlp_only_layers", None) or ())
        bad = sorted(i for i in only_dense if not 0 <= i < n)
        if bad:
            raise UnsupportedModelError(
                f"config field 'mlp_only_layers' names layers {bad} outside 0..{n - 1}"
            )
        num_experts = _field(text, "num_experts")
        sparse = tuple(i not in only_dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
        dense = _field(text, "intermediate_size") if not all(sparse) else None
        moe = _qwen_moe(text, bool(_field(text, "norm_topk_prob")))
        return FamilyConfig(family, layer_types, sparse, dense, moe, None, None)
    return _kimi(text, layer_types)


def _kimi(text: Any, layer_types: tuple[str, ...]) -> FamilyConfig:
    if getattr(text, "mla_use_nope", True) is False:
        raise UnsupportedModelError("config field 'mla_use_nope' is false: MLA with RoPE is not supported")
    activation = getattr(text, "moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise UnsupportedModelError(
            f"config field 'moe_router_activation_func' is {activation!r}, not 'sigmoid'"
        )
    mlp_types = getattr(text, "mlp_layer_types", None)
    if mlp_types is None or len(mlp_types) != len(layer_types):
        raise UnsupportedModelError(f"config field 'mlp_layer_types' must list {len(layer_types)} layers")
    for i, kind in enumerate(mlp_types):
        if kind not in ("dense", "sparse"):
            raise UnsupportedModelError(
                f"config field 'mlp_layer_types[{i}]' is {kind!r}; 'dense' or 'sparse'"
            )
    sparse = tuple(kind == "sparse" for kind in mlp_types)
    if _field(text, "num_key_value_heads") != _field(text, "num_attention_heads"):
        raise UnsupportedModelError(
            "config field 'num_key_value_heads' must equal num_attention_heads for MLA"
        )
    shared = _field(text, "n_shared_experts") or 0
    moe = MoeConfig(
        hidden_size=_field(text, "hidden_size"),
        num_experts=_field(text, "num_local_experts"),
        top_k=_field(text, "num_experts_per_tok"),
        intermediate_size=_field(text, "moe_intermediate_size"),
        shared_intermediate_size=_field(text, "moe_intermediate_size") * shared,
        shared_gate=False,
        router="sigmoid",
        norm_topk_prob=bool(_field(text, "norm_topk_prob")),
        routed_scaling_factor=float(_field(text, "routed_scaling_factor")),
        num_groups=_field(text, "n_group") or 1,
        topk_group=_field(text, "topk_group") or 1,
        correction_bias=True,
    )
    kda = None
    if LINEAR_ATTENTION in layer_types:
        kda = KdaConfig(
            num_heads=_field(text, "linear_num_heads"),
            head_dim=_field(text, "linear_head_dim"),
            conv_kernel=_field(text, "linear_conv_kernel_dim"),
            norm_eps=float(_field(text, "rms_norm_eps")),
        )
    mla = None
    if FULL_ATTENTION in layer_types:
        # config.head_dim is the rope dim in transformers' Kimi config: read the MLA fields, never head_dim
        mla = MlaConfig(
            num_heads=_field(text, "num_attention_heads"),
            q_lora_rank=getattr(text, "q_lora_rank", None),
            kv_lora_rank=_field(text, "kv_lora_rank"),
            qk_nope_head_dim=_field(text, "qk_nope_head_dim"),
            qk_rope_head_dim=_field(text, "qk_rope_head_dim"),
            v_head_dim=_field(text, "v_head_dim"),
            bias=bool(getattr(text, "attention_bias", False)),
        )
    dense = _field(text, "intermediate_size") if not all(sparse) else None
    return FamilyConfig("kimi_linear", layer_types, sparse, dense, moe, kda, mla)


def check_kimi_layer_lists(raw: dict[str, Any]) -> None:
    """The checkpoint's `linear_attn_config.kda_layers` and `full_attn_layers` (1-based) must together name
    every layer 1..num_hidden_layers exactly once (transformers' config otherwise fails on a None type)."""
    lists = raw.get("linear_attn_config") or {}
    if "kda_layers" not in lists or "full_attn_layers" not in lists:
        return
    n = raw.get("num_hidden_layers")
    seen: dict[int, str] = {}
    for field in ("kda_layers", "full_attn_layers"):
        for layer in lists[field]:
            name = f"linear_attn_config.{field}"
            if not isinstance(layer, int) or not 1 <= layer <= n:
                raise UnsupportedModelError(f"config field {name!r} names layer {layer!r}; layers are 1..{n}")
            if layer in seen:
                raise UnsupportedModelError(
                    f"config field {name!r} names layer {layer}, already in {seen[layer]!r}"
                )
            seen[layer] = name
    missing = sorted(set(range(1, n + 1)) - set(seen))
    if missing:
        raise UnsupportedModelError(
            "config fields 'linear_attn_config.kda_layers' and 'full_attn_layers' (1-based) "
            f"do not name layers {missing}"
        )


def load_hf_family_config(folder: str | Path) -> Any:
    """The transformers config of a local MoE / Kimi Linear checkpoint folder (any refusal typed)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    raw = json.loads((Path(folder) / "config.json").read_text())
    if raw.get("model_type") == "kimi_linear":
        check_kimi_layer_lists(raw)
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (StrictDataclassError, TypeError, ValueError) as e:  # transformers' field validation
        raise UnsupportedModelError(
            f"config.json in {folder} is not a valid {raw.get('model_type')!r} config: {e}"
        ) from e


def load_family_config(folder: str | Path) -> FamilyConfig:
    """The family extras of a local checkpoint folder's config.json (any refusal typed)."""
    return family_config_from_hf(load_hf_family_config(folder))
