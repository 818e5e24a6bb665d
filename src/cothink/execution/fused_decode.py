"""The decoder layers of a small decode step in one C call (ops/native.py `decode_layers`).

A single-stream decode step of SmolLM2 spends ~20 ms in its matmuls and another ~10 in Python: per
layer a dozen module calls and eight kernel calls, each with its tensor allocations and ctypes
argument conversions. For steps the per-module path would run entirely in cothink's C kernels
(every item decoding one token under the native attention backend, at most NATIVE_MAX_ROWS rows,
a float32 or bfloat16 Llama-family model whose linears all take the C kernel, with weights of the
model dtype or int8), the runner runs the
layers in one call that makes the same kernel calls in the same order: the result is the same to
the bit, and the step loses the Python around them. Other steps, models and backends take the
per-module path unchanged.
"""

from __future__ import annotations

import torch

from cothink.execution.attention_backends import NativeAttention
from cothink.execution.step import ViewBatch
from cothink.models.packing import NATIVE_MAX_ROWS, NativeLinear
from cothink.models.transformer import CausalLM, ForwardContext
from cothink.ops import native


class FusedDecode:
    """Runs a model's decoder layers for eligible decode steps (`for_model`, then `fits` per step)."""

    def __init__(self, model: CausalLM, weights: torch.dtype):
        cfg = model.config
        self.weights = weights  # the linears' storage: the model dtype or int8
        self.shape = native.LayerShape(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps,
        )
        self._tensors = [_layer_tensors(layer) for layer in model.model.layers]  # the table points into them
        self.table = torch.tensor(
            [[0 if layer[f] is None else layer[f].data_ptr() for f in native.LAYER_FIELDS]
             for layer in self._tensors],
            dtype=torch.int64,
        )

    @classmethod
    def for_model(cls, model: CausalLM, backend: object) -> FusedDecode | None:
        """The fused layers for `model`, or None where its steps keep the per-module path: another
        backend than "native", another architecture (q/k norms, output gates, Gated DeltaNet) or
        linears that do not run in the C kernel (oneDNN-packed bfloat16, the eager modules) or of
        mixed storage."""
        cfg = model.config
        if not isinstance(backend, NativeAttention) or cfg.head_dim % 16:
            return None
        if cfg.qk_norm or cfg.attn_output_gate or cfg.zero_centred_norm or cfg.linear_layers:
            return None
        layers = model.model.layers
        linears = [m for layer in layers for m in _linears(layer)]
        if any(not isinstance(m, NativeLinear) or m.native_rows < NATIVE_MAX_ROWS for m in linears):
            return None
        dtype = layers[0].input_layernorm.weight.dtype  # the activations'
        storage = {m.operands()[0].dtype for m in linears}
        if storage not in ({dtype}, {torch.int8}) or not all(m.takes_dtype(dtype) for m in linears):
            return None
        norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
        if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for pair in norms for n in pair):
            return None
        return cls(model, storage.pop())

    def fits(self, batch: ViewBatch) -> bool:
        """Whether the per-module path would run this step wholly in the C kernels."""
        # native items (and with them the key store's slots) exist only under the native backend
        every_item_native = len(batch.native_items) == len(batch.plans)
        return every_item_native and batch.rows <= NATIVE_MAX_ROWS and native.available()

    def __call__(self, x: torch.Tensor, batch: ForwardContext) -> torch.Tensor:
        assert isinstance(batch, ViewBatch)
        pool = batch.store.pool
        x = x.contiguous()
        native.decode_layers(
            x, self.table, self.shape, pool.k, pool.v, batch.store_slots, *batch.key_rotation,
            batch.native_decode, batch.scale, self.weights,
        )
        return x


def _linears(layer: torch.nn.Module) -> list[object]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """One layer's tensors by native.LAYER_FIELDS name."""
    attn, mlp = layer.self_attn, layer.mlp
    tensors = {
        "in_norm": layer.input_layernorm.weight.data, "post_norm": layer.post_attention_layernorm.weight.data
    }
    for name, linear in (
        ("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)
    ):
        tensors[name], tensors[f"{name}_scale"], tensors[f"{name}_bias"] = linear.operands()
    return tensors
