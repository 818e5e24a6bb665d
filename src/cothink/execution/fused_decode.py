"""The decoder layers of a small decode step in one C call (ops/native.py `decode_layers`).

A single-stream decode step of SmolLM2 spends ~20 ms in its matmuls and another ~10 in Python: per
layer a dozen module calls and eight kernel calls, each with its tensor allocations and ctypes
argument conversions. For steps the per-module path would run entirely in cothink's C kernels
(every item decoding one token under the native attention backend, at most NATIVE_MAX_ROWS rows,
a float32 or bfloat16 Llama, Qwen3 or Qwen3.5 model whose linears all take the C kernel, with
weights of the model dtype or int8), the runner runs the layers in one call that makes the same
kernel calls in the same order: the result is the same to the bit, and the step loses the Python
around them. For the Qwen3.5 hybrid the step's Gated DeltaNet bookkeeping (each item's state before
its token, buffers for the new state, conv tail and records) is done by the ViewBatch first
(`linear_decode`). Other steps, models and backends take the per-module path unchanged.
"""

from __future__ import annotations

import torch

from cothink.execution.attention_backends import NativeAttention
from cothink.execution.linear_state import token_shape
from cothink.execution.step import LinearDecode, ViewBatch
from cothink.models.packing import NATIVE_MAX_ROWS, NativeLinear
from cothink.models.transformer import CausalLM, ForwardContext, GatedDeltaNet
from cothink.ops import native


class FusedDecode:
    """Runs a model's decoder layers for eligible decode steps (`for_model`, then `fits` per step)."""

    def __init__(self, model: CausalLM, weights: torch.dtype, tensors: list[dict[str, torch.Tensor | None]]):
        """`tensors`: each layer's by native.LAYER_FIELDS name (`_layer_tensors`); the table points
        into them."""
        cfg = model.config
        self.weights = weights  # the linears' storage: the model dtype or int8
        g = cfg.gdn
        self.shape = native.LayerShape(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps, cfg.attn_output_gate, cfg.zero_centred_norm,
            token_shape(g) if g else None,
            g.conv_kernel if g else 0,
        )
        layers = model.model.layers
        kv_slot = {layer: i for i, layer in enumerate(cfg.attention_layers)}  # the key pool's order
        self._tensors = tensors
        self.table = torch.tensor(
            [[kv_slot.get(i, -1) if f == "kv_slot" else _pointer(layer[f]) for f in native.LAYER_FIELDS]
             for i, layer in enumerate(tensors)],
            dtype=torch.int64,
        )
        self.linear_mixers = {i: layers[i].linear_attn for i in cfg.linear_layers}

    @classmethod
    def for_model(cls, model: CausalLM, backend: object) -> FusedDecode | None:
        """The fused layers for `model`, or None where its steps keep the per-module path: another
        backend than "native", layers the kernels do not chain (a Gated DeltaNet model without
        attention layers, a conv kernel of width 1), or parts that do not run in the C kernels
        (oneDNN-packed bfloat16 or mixed-storage linears, the eager modules, parameters of another
        dtype than the activations)."""
        cfg = model.config
        if not isinstance(backend, NativeAttention) or cfg.head_dim % 16 or not cfg.attention_layers:
            return None
        if cfg.gdn is not None and cfg.gdn.conv_kernel < 2:
            return None
        layers = model.model.layers
        if any(_mixer(layer) is None for layer in layers):  # unfused projections: the eager modules
            return None
        linears = [m for layer in layers for m in _linears(layer)]
        if any(not isinstance(m, NativeLinear) or m.native_rows < NATIVE_MAX_ROWS for m in linears):
            return None
        dtype = layers[0].input_layernorm.weight.dtype  # the activations'
        storage = {m.operands()[0].dtype for m in linears}
        if storage not in ({dtype}, {torch.int8}) or not all(m.takes_dtype(dtype) for m in linears):
            return None
        tensors = [_layer_tensors(layer) for layer in layers]
        params = [t for layer in tensors for name, t in layer.items()
                  if t is not None and name not in _LINEAR_FIELDS]
        if any(t.dtype != dtype or not t.is_contiguous() for t in params):
            return None
        return cls(model, storage.pop(), tensors)

    def fits(self, batch: ViewBatch) -> bool:
        """Whether the per-module path would run this step wholly in the C kernels."""
        # native items (and with them the key store's slots) exist only under the native backend
        every_item_native = len(batch.native_items) == len(batch.plans)
        return every_item_native and batch.rows <= NATIVE_MAX_ROWS and native.available()

    def __call__(self, x: torch.Tensor, batch: ForwardContext) -> torch.Tensor:
        assert isinstance(batch, ViewBatch)
        pool = batch.store.pool
        x = x.contiguous()
        steps = {i: batch.linear_decode(i, mixer, x.dtype) for i, mixer in self.linear_mixers.items()}
        native.decode_layers(
            x, self.table, self.shape, pool.k, pool.v, batch.store_slots, *batch.key_rotation,
            batch.native_decode, batch.scale, self.weights, self._linear_io(steps, len(batch.plans)),
        )
        return x

    def _linear_io(self, steps: dict[int, LinearDecode], items: int) -> torch.Tensor | None:
        """The Gated DeltaNet layers' rows of ct_decode_layers' linear_io table (others: zeros)."""
        if not steps:
            return None
        width = native.LINEAR_STEP_FIELDS + items * native.LINEAR_ITEM_FIELDS
        rows = []
        for i in range(self.table.shape[0]):
            step = steps.get(i)
            if step is None:
                rows.append([0] * width)
                continue
            row = [step.rows.data_ptr(), step.g.data_ptr(), step.beta.data_ptr()]
            for before, after in zip(step.before, step.after):
                row += [before.tail.data_ptr(), before.tail.stride(0), before.state.data_ptr(),
                        after.state.data_ptr(), after.tail.data_ptr()]
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64)


# the fields of the linears (and their biases, scales): checked as NativeLinear operands
_LINEAR_FIELDS = {f"{name}{suffix}" for name in ("mix_in", "mix_out", "gate_up", "down")
                  for suffix in ("", "_bias", "_scale")}


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _mixer(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's attention or Gated DeltaNet, with its input projections fused (else None)."""
    mixer = layer.mixer
    fused = mixer.in_proj if isinstance(mixer, GatedDeltaNet) else mixer.qkv_proj
    return mixer if fused is not None else None


def _linears(layer: torch.nn.Module) -> list[object]:
    mixer = _mixer(layer)
    if isinstance(mixer, GatedDeltaNet):
        return [mixer.in_proj, mixer.out_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return [mixer.qkv_proj, mixer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """One layer's tensors by native.LAYER_FIELDS name (kv_slot aside)."""
    mixer, mlp = _mixer(layer), layer.mlp
    tensors: dict[str, torch.Tensor | None] = {
        "in_norm": layer.input_layernorm.weight.data, "post_norm": layer.post_attention_layernorm.weight.data,
        "q_norm": None, "k_norm": None, "conv": None, "a_log": None, "dt_bias": None, "gated_norm": None,
    }
    if isinstance(mixer, GatedDeltaNet):
        tensors.update(conv=mixer.conv_weight.data, a_log=mixer.A_log.data, dt_bias=mixer.dt_bias.data,
                       gated_norm=mixer.norm.weight.data)
    elif mixer.q_norm is not None:
        tensors.update(q_norm=mixer.q_norm.weight.data, k_norm=mixer.k_norm.weight.data)
    mix_in, mix_out = _linears(layer)[:2]
    for name, linear in (("mix_in", mix_in), ("mix_out", mix_out), ("gate_up", mlp.gate_up_proj),
                         ("down", mlp.down_proj)):
        tensors[name], tensors[f"{name}_scale"], tensors[f"{name}_bias"] = linear.operands()
    return tensors
