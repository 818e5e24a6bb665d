"""The decoder layers of a small decode step in one C call (ops/native.py `decode_layers`).

A single-stream decode step of SmolLM2 spends ~20 ms in its matmuls and another ~10 in Python: per
layer a dozen module calls and eight kernel calls, each with its tensor allocations and ctypes
argument conversions. For steps the per-module path would run entirely in cothink's C kernels
(every item decoding one token under the native backend, at most `max_rows` rows: NATIVE_MAX_ROWS,
or fewer where a linear takes the C kernel only for fewer rows; a float32 or bfloat16 Llama, Qwen3
or Qwen3.5 model whose linears all take the C kernel, with weights of the model dtype, int8 or
4-bit), the native backend runs the layers in one call that makes the same kernel
calls in the same order: the result is the same to the bit, and the step loses the Python around
them. Where every row wants its logits and the final norm and the lm_head take the C kernels too, the
same call makes the logits (`logits`). The backend's `prepare` decides it and builds the step's input
(`FusedStep`); for the Qwen3.5 hybrid, the step's Gated DeltaNet bookkeeping (each item's state
before its token, buffers for the new state, conv tail and records) comes from the step's
`linear_decode`, called during the forward.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from cothink.execution.native_modules import NATIVE_MAX_ROWS, NativeLinear, NativeRMSNorm, token_shape
from cothink.execution.step import LinearDecode
from cothink.models.transformer import CausalLM, DecoderLayers, ForwardContext, GatedDeltaNet
from cothink.ops import native

# a Gated DeltaNet layer's buffers for the step: linear_decode(layer, mixer, dtype)
# (execution/step.py ViewBatch.linear_decode)
LinearDecoder = Callable[[int, GatedDeltaNet, torch.dtype], LinearDecode]


@dataclass(frozen=True, slots=True)
class FusedStep:
    """What the fused decode step reads of one step: built once by the native backend's `prepare`."""

    pool_k: torch.Tensor  # [attention layers, S, Hkv, D] the key pool
    pool_v: torch.Tensor
    store_slots: torch.Tensor  # [T] where each row's new key goes
    key_cos: torch.Tensor  # [T, 1, rot] the new keys' rotation (Rotary.prepare)
    key_sin: torch.Tensor
    plan: native.DecodePlan  # the items' key runs (every item: one row, row i is item i)
    scale: float  # the attention's softmax scale
    items: int
    linear_decode: LinearDecoder


Operands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # NativeLinear.operands()


@dataclass(frozen=True, slots=True)
class Head:
    """The final norm and the lm_head as the fused call runs them after the layers: `struct` points into
    `norm` and `operands` (held here so they outlive it); a call sets only its logits buffer."""

    norm: torch.Tensor  # the final norm's weight
    operands: Operands  # the lm_head's
    vocab: int
    max_rows: int  # rows up to which the lm_head takes the C kernel
    struct: native.CtHead


class FusedDecode:
    """Runs a model's decoder layers in one C call (`for_model`; the native backend's `prepare`
    decides per step and builds its `FusedStep`)."""

    def __init__(self, model: CausalLM, weights: int, params: list[dict[str, torch.Tensor | None]],
                 linears: list[dict[str, Operands]], head: Head | None = None):
        """Each layer's tensors by native.CtLayer field (`_layer_params`, `_layer_linears`): the
        layer table points into them. `head`: the final norm and lm_head the call also runs (None:
        the layers only)."""
        cfg = model.config
        self.weights = weights  # the linears' storage kind (`native.weight_kind`)
        g = cfg.gdn
        self.shape = native.LayerShape(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps, cfg.attn_output_gate, cfg.zero_centred_norm,
            token_shape(g) if g else None,
            g.conv_kernel if g else 0,
        )
        layers = model.model.layers
        kv_slot = {layer: i for i, layer in enumerate(cfg.attention_layers)}  # the key pool's order
        self._tensors = (params, linears)
        self.head = head
        self.table = (native.CtLayer * len(layers))(*[
            native.CtLayer(
                kv_slot=kv_slot.get(i, -1),
                **{name: _pointer(t) for name, t in params[i].items()},
                **{name: native.CtLinear(*map(_pointer, ops)) for name, ops in linears[i].items()},
            )
            for i in range(len(layers))
        ])
        self.linear_mixers = {i: layers[i].linear_attn for i in cfg.linear_layers}
        # rows up to which every linear takes the C kernel, NATIVE_MAX_ROWS at most (4-bit weights in
        # pairs take any rows): the widest step this runs (the native backend's `prepare` checks it)
        self.max_rows = min(NATIVE_MAX_ROWS, *(m.native_rows for layer in layers for m in _linears(layer)))

    @classmethod
    def for_model(cls, model: CausalLM) -> FusedDecode | None:
        """The fused layers for `model` (its native modules swapped in), or None where its steps keep
        the per-module path: layers the kernels do not chain (a Gated DeltaNet model without
        attention layers, a conv kernel of width 1), or parts that do not run in the C kernels
        (oneDNN-packed bfloat16 or mixed-storage linears, the eager modules, parameters of another
        dtype than the activations)."""
        cfg = model.config
        if not model.fused:  # the eager modules (and the MoE / Kimi Linear families, which run them)
            return None
        if cfg.head_dim % 16 or not cfg.attention_layers:
            return None
        if cfg.gdn is not None and cfg.gdn.conv_kernel < 2:
            return None
        layers = model.model.layers
        if any(_mixer(layer) is None for layer in layers):  # unfused projections: the eager modules
            return None
        linears = [m for layer in layers for m in _linears(layer)]
        if any(not isinstance(m, NativeLinear) or m.native_rows < 1 for m in linears):
            return None
        dtype = layers[0].input_layernorm.weight.dtype  # the activations'
        storage = {native.weight_kind(*m.operands()[:2]) for m in linears}
        # one kind for every layer: model-dtype, int8, 4-bit (uint8: two codes per byte), bfloat16 pairs
        # (int32), int8 pairs (int16) or 4-bit pairs (uint16, float32 or half scales) weights
        other_dtype = {kind for t, kind in native.DTYPES.items() if t != dtype}
        if len(storage) != 1 or storage & other_dtype or not all(m.takes_dtype(dtype) for m in linears):
            return None
        params = [_layer_params(layer) for layer in layers]
        tensors = [t for p in params for t in p.values() if t is not None]
        if any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
            return None
        layer_linears = [_layer_linears(layer) for layer in layers]
        return cls(model, storage.pop(), params, layer_linears, _head(model, dtype))

    def __call__(self, x: torch.Tensor, step: FusedStep, logits: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] after the embedding -> after the last decoder layer (updated in place); with
        `logits` [T, vocab] float32 (a `head`, at most its max_rows), every row's logits into it too."""
        x = x.contiguous()
        steps = {i: step.linear_decode(i, mixer, x.dtype) for i, mixer in self.linear_mixers.items()}
        linear_io, _items = self._linear_io(steps, step.items)  # the item arrays live through the call
        head = None
        if logits is not None:
            assert self.head is not None and x.shape[0] <= self.head.max_rows
            head = self.head.struct
            head.logits = logits.data_ptr()  # (steps run one at a time, on the compute thread)
        native.decode_layers(
            x, self.table, self.shape, step.pool_k, step.pool_v, step.store_slots, step.key_cos,
            step.key_sin, step.plan, step.scale, self.weights, linear_io, head,
        )
        return x

    def layers(self, step: FusedStep) -> DecoderLayers:
        """The model's decoder layers for this step (CausalLM.forward's `layers`)."""

        def run(x: torch.Tensor, _ctx: ForwardContext) -> torch.Tensor:
            return self(x, step)

        return run

    def logits(self, step: FusedStep) -> DecoderLayers | None:
        """The step from its embeddings to every row's float32 logits in the one call (CausalLM.forward's
        `to_logits`), or None where the final norm and lm_head do not run in it (no `head`, or more rows
        than its lm_head takes in the C kernel)."""
        head = self.head
        if head is None or step.items > head.max_rows:
            return None

        def run(x: torch.Tensor, _ctx: ForwardContext) -> torch.Tensor:
            out = torch.empty(x.shape[0], head.vocab, dtype=torch.float32)
            self(x, step, out)
            return out

        return run

    def _linear_io(
        self, steps: dict[int, LinearDecode], items: int
    ) -> tuple[ctypes.Array[native.CtLinearIO] | None, list[ctypes.Array[native.CtLinearItem]]]:
        """The Gated DeltaNet layers' entries of ct_decode_layers' linear_io (attention layers' are
        left empty), and the per-item arrays they point to."""
        if not steps:
            return None, []
        io = _array_type(native.CtLinearIO, len(self.table))()
        held = []
        for i, step in steps.items():
            per_item = _array_type(native.CtLinearItem, items)(*[
                native.CtLinearItem(
                    tail=before.tail.data_ptr(), tail_stride=before.tail.stride(0),
                    state=before.state.data_ptr(), state_out=after.state.data_ptr(),
                    tail_out=after.tail.data_ptr(),
                )
                for before, after in zip(step.before, step.after)
            ])
            held.append(per_item)
            io[i] = native.CtLinearIO(
                rows=step.rows.data_ptr(), g=step.g.data_ptr(), beta=step.beta.data_ptr(),
                # (a pointer to the first item: ctypes.cast would tie the array and the pointer in a cycle)
                items=ctypes.pointer(per_item[0]),
            )
        return io, held


@cache
def _array_type(item: type[ctypes.Structure], n: int) -> type[ctypes.Array]:
    """`item * n`, kept: ctypes holds array types weakly, and a type freed each step is work for Python's
    cycle collector (a type object always sits in reference cycles)."""
    return item * n


def _head(model: CausalLM, dtype: torch.dtype) -> Head | None:
    """The final norm and lm_head as the fused call runs them, or None where the per-module path would
    not run them in the C kernels (`NativeRMSNorm`'s and `NativeLinear.float_forward`'s conditions) or
    the norm differs from the layers' (the call's norm takes the layers' eps and centring)."""
    norm, lm_head, cfg = model.model.norm, model.lm_head, model.config
    if not isinstance(norm, NativeRMSNorm) or not isinstance(lm_head, NativeLinear):
        return None
    if norm.eps != cfg.rms_norm_eps or norm.zero_centred != cfg.zero_centred_norm:
        return None
    weight = norm.weight.data
    if weight.dtype != dtype or not weight.is_contiguous() or not lm_head.takes_dtype(dtype):
        return None
    operands = lm_head.operands()
    if lm_head.native_rows < 1 or any(t is not None and not t.is_contiguous() for t in operands):
        return None
    struct = native.CtHead(_pointer(weight), native.CtLinear(*map(_pointer, operands)),
                           native.weight_kind(*operands[:2]), lm_head.out_features, None)
    return Head(weight, operands, lm_head.out_features, lm_head.native_rows, struct)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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


def _layer_params(layer: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """One layer's tensors other than its linears, by native.CtLayer field."""
    mixer = _mixer(layer)
    params: dict[str, torch.Tensor | None] = {
        "in_norm": layer.input_layernorm.weight.data, "post_norm": layer.post_attention_layernorm.weight.data,
        "q_norm": None, "k_norm": None, "conv": None, "a_log": None, "dt_bias": None, "gated_norm": None,
    }
    if isinstance(mixer, GatedDeltaNet):
        params.update(conv=mixer.conv_weight.data, a_log=mixer.A_log.data, dt_bias=mixer.dt_bias.data,
                      gated_norm=mixer.norm.weight.data)
    elif mixer.q_norm is not None:
        params.update(q_norm=mixer.q_norm.weight.data, k_norm=mixer.k_norm.weight.data)
    return params


def _layer_linears(layer: torch.nn.Module) -> dict[str, Operands]:
    """One layer's linears' operands (weight, int8 scales, bias), by native.CtLayer field."""
    mix_in, mix_out, gate_up, down = _linears(layer)
    return {"mix_in": mix_in.operands(), "mix_out": mix_out.operands(), "gate_up": gate_up.operands(),
            "down": down.operands()}
