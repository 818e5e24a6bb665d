"""Load a decoder's weights from the safetensors files of a local Hugging Face folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from cothink.errors import UnsupportedModelError
from cothink.models.config import LINEAR_ATTENTION, ModelConfig, VisionConfig
from cothink.models.hybrid_weights import split_qwen3_next_projections
from cothink.models.kda import fuse_kda_convs
from cothink.models.moe import KIMI_EXPERT_NAMES, QWEN_EXPERT_NAMES, fuse_expert_weights
from cothink.models.packing import pack_linears
from cothink.models.quant4 import checkpoint_gguf, quantize_int4
from cothink.models.quantize import check_quantize, quantize_int8
from cothink.models.transformer import CausalLM
from cothink.models.vision import VisionTower

# Real Qwen3.5 checkpoints use the multimodal layout: the text decoder under model.language_model,
# the vision tower under model.visual and a multi-token-prediction head under mtp. The text decoder's
# state skips the tower (load_vision_tower reads it) and the mtp head (never used).
_RENAMES = (("model.language_model.", "model."),)
_VISION_PREFIXES = ("model.visual.", "visual.")
_SKIPPED = (*_VISION_PREFIXES, "mtp.", "model.mtp.")


def _checkpoint_name(name: str) -> str | None:
    if name.startswith(_SKIPPED):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def read_state_dict(
    folder: Path, dtype: torch.dtype, rename: Callable[[str], str | None] = _checkpoint_name
) -> dict[str, torch.Tensor]:
    """The tensors of every *.safetensors file of `folder` that `rename` keeps, under its names."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = rename(key)
                if name is not None:
                    state[name] = f.get_tensor(key).to(dtype)
    return state


def _vision_name(name: str) -> str | None:
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def _check_layout(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, family: str) -> None:
    """UnsupportedModelError (naming `what`) unless `state` has exactly the tensors of `module`."""
    expected = set(module.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise UnsupportedModelError(
            f"{what} does not match the {family} layout: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )


def load_vision_tower(
    cfg: VisionConfig, folder: Path, dtype: torch.dtype, device: str | torch.device
) -> VisionTower:
    """Build the vision tower and fill it from the checkpoint's `model.visual.*` tensors (all present).

    The patch embedding's Conv3d weight [hidden, C, tp, p, p] is stored flattened [hidden, C*tp*p*p]:
    the tower applies it as a linear map of the flattened patch (models/vision.py)."""
    with torch.device("meta"):
        tower = VisionTower(cfg)
    state = read_state_dict(folder, dtype, rename=_vision_name)
    conv = state.get("patch_embed.proj.weight")
    if conv is not None and conv.dim() == 5:
        state["patch_embed.proj.weight"] = conv.reshape(conv.shape[0], -1)
    _check_layout(tower, state, f"vision tower in {folder}", cfg.family)
    tower.load_state_dict(state, assign=True)
    return tower.to(device).eval()


def load_weights(
    cfg: ModelConfig,
    folder: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    fuse: bool = True,
    quantize: str | None = None,
) -> CausalLM:
    """Build the model and fill it from the checkpoint; every parameter must be present.

    `fuse` concatenates the projections that share an input (models/transformer.py, the fast
    path) and, on CPU, gives the linears the kernel for their dtype and row count (models/packing.py);
    `quantize="int8"` makes the linear weights int8 (models/quantize.py), "int4" 4-bit groups
    (models/quant4.py)."""
    check_quantize(quantize, cfg.family)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = read_state_dict(folder, dtype)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if cfg.family_config is not None:
        to_family_layout(cfg, state)
    _check_layout(model, state, f"checkpoint in {folder}", cfg.family)
    model.load_state_dict(state, assign=True)
    model = model.to(device).eval()
    if fuse:
        model.fuse_projections()
    if quantize == "int8":
        quantize_int8(model)
    elif quantize == "int4":  # an embedded model's 4-bit GGUF tensors as they are, where it has them
        quantize_int4(model, checkpoint_gguf(folder))
    elif fuse and torch.device(device).type == "cpu":
        pack_linears(model, dtype)  # the CPU kernel for each dtype and row count (models/packing.py)
    return model


# Kimi Linear's checkpoint names -> the modules' (transformers holds the forget gate's tensors under
# `forget_gate.` in memory; a checkpoint may carry either spelling)
_KIMI_RENAMES = ((".block_sparse_moe.", ".mlp."), (".self_attn.forget_gate.", ".self_attn."))


def to_family_layout(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Bring a MoE / Kimi Linear checkpoint's tensors to the layout of cothink's modules, in place:
    experts stacked into the fused [E, 2I, H] / [E, H, I] pair (from per-expert tensors or already
    fused), Qwen3-Next's grouped Gated DeltaNet projections split into Qwen3.5's, Kimi's KDA convs
    concatenated and its MoE renamed from `block_sparse_moe` to `mlp`. UnsupportedModelError names a
    missing or misshapen tensor; anything else unexpected is named by the layout check after."""
    fam = cfg.family_config
    assert fam is not None
    kimi = fam.family == "kimi_linear"
    names, moe_name = (KIMI_EXPERT_NAMES, "block_sparse_moe") if kimi else (QWEN_EXPERT_NAMES, "mlp")
    for layer, sparse in enumerate(fam.sparse_layers):  # under the checkpoint's names, so errors name them
        prefix = f"model.layers.{layer}"
        if sparse:
            fuse_expert_weights(state, f"{prefix}.{moe_name}.experts", fam.moe, names)
        if fam.layer_types[layer] != LINEAR_ATTENTION:
            continue
        if kimi:
            assert fam.kda is not None
            fuse_kda_convs(state, f"{prefix}.self_attn", fam.kda)
        elif f"{prefix}.linear_attn.in_proj_qkvz.weight" in state:  # Qwen3-Next's grouped layout
            assert cfg.gdn is not None
            split_qwen3_next_projections(state, f"{prefix}.linear_attn", cfg.gdn)
    if kimi:
        for key in list(state):
            new = key
            for old, repl in _KIMI_RENAMES:
                new = new.replace(old, repl)
            if new != key:
                state[new] = state.pop(key)
