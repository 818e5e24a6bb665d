"""Shared test support: one zoo of tiny random-weight models, engines over them, recording and replay.

The zoo (`ZOO(name)`, also the `tiny_model` fixture) builds the transformers model of a spec in
TINY_SPECS (seeded, fp32), perturbs the weights that a fresh init leaves trivial (`perturb`), saves it with
`save_pretrained` and a tiny byte-level tokenizer (256 byte tokens + 44 whole-word tokens, vocabulary 300,
no EOS) to a per-process temp folder, and keeps the transformers model as the reference. Models are built
lazily, on first use, so running one test file only builds what it needs.

Engine helpers: `tiny_folder(kind)`, `load_runner(kind)`, `fresh_runner(runner)`, `make_engine(kind)`.

`Recorder` + `replay` reproduce what an engine did, one item at a time, on a fresh runner: the recorder
notes, after every engine step, the length of every tracked block; the replay writes each block's new
tokens with `runner.step([StepItem(..., read_lengths=<lengths at step start>)])`, which is exactly the
visibility the step semantics promise (docs/runtime.md: each item reads the view as it was at the start
of the step plus its own tokens).

Server helpers (a tiny chat model with SmolLM2's tokenizer, a real server on loopback) are here too.

Torch threads: tests/conftest.py pins one torch thread for every test (the `torch_threads` marker opts a
test out); `one_torch_thread` stays importable for modules that name it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import json
import random
import shutil
import socket
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import httpx
import pytest
import torch
from reference import max_err, random_ids

import cothink
from cothink.execution.runner import ModelRunner
from cothink.execution.step import StepItem
from cothink.memory.block import Block

if TYPE_CHECKING:  # the engine is imported where used: lower-layer tests do not depend on it
    from cothink.runtime.engine import Engine, StepRecord

__all__ = [
    "ATOL", "FULL", "LINEAR", "LINEAR_ONLY_GENERATE_BROKEN", "NO", "QUICK_KERNEL_BUILD", "TINY_SPECS",
    "VOCAB", "WORDS", "YES",
    "Recorder", "Replay", "Spec", "TinyModel", "Zoo", "ZOO", "check_greedy", "count_fused_decode_rows",
    "count_native_rows",
    "fast_and_eager", "fresh_runner", "ids", "load_runner", "make_engine", "make_tokenizer", "max_err",
    "one_torch_thread", "perturb", "prefill_then_decode", "random_ids", "record_error", "replay",
    "running_server", "smollm2_dir", "smollm2_runner", "snapshot", "sse_events", "tiny_chat_model_dir",
    "tiny_engine", "tiny_folder", "tiny_hybrid_moe", "tiny_kimi_config", "tiny_model", "tiny_vision_folder",
    "until",
    "write_blocks_with_random_views",
]

# Extra compiler flags for tests that build cothink's C kernels into a fresh cache (a rebuild, a wheel's
# first use, the fallbacks): they check which library loads and that it runs, not its speed, and -O1
# builds native.c in ~4 s where the default -O3 takes ~15 on two cores (ops/native.py _FLAGS; the
# later -O wins).
QUICK_KERNEL_BUILD = "-O1"
VOCAB = 300
ATOL = 1e-5  # fp32 logits: batched vs alone
FULL, LINEAR = "full_attention", "linear_attention"
# whole-word tokens (ids 256..299): probes can use single-token choices " yes" / " no"
WORDS = [" yes", " no", "Answer:", " maybe"] + [f"<w{i}>" for i in range(40)]
YES, NO = 256, 257
# transformers 5.23: generate() on a Qwen3.5 model with only linear-attention layers raises ValueError
# ("`get_seq_length` can only be called on Attention layers") when it builds the cache.
LINEAR_ONLY_GENERATE_BROKEN = True
_NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


# ---- the zoo -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """A tiny model: which transformers classes build it, with which config keywords and seed."""

    family: str  # llama | qwen2 | qwen3 | qwen3_5 | qwen3_5_mm | qwen3_vl
    config: dict[str, Any]
    seed: int | None = None  # None: a stable hash of the name
    extra_tensors: bool = False  # add fake mtp.* tensors to the safetensors file


def _llama(seed: int | None = None, **kw: Any) -> Spec:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                max_position_embeddings=8192, tie_word_embeddings=False, **_NO_SPECIAL)
    return Spec("llama", {**base, **kw}, seed)


def _qwen2(**kw: Any) -> Spec:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                max_position_embeddings=4096, tie_word_embeddings=False, **_NO_SPECIAL)
    return Spec("qwen2", {**base, **kw})


def _qwen3(**kw: Any) -> Spec:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                max_position_embeddings=4096, tie_word_embeddings=False, **_NO_SPECIAL)
    return Spec("qwen3", {**base, **kw})


_QWEN35_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    # head_dim 32 with the default partial rotary factor 0.25: 8 rotary channels
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    # GQA in GDN: 2 value heads per key head
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    initializer_range=0.1, max_position_embeddings=8192, **_NO_SPECIAL)


def _qwen35(layer_types: list[str], seed: int | None = None, **kw: Any) -> Spec:
    config = {**_QWEN35_TEXT, "num_hidden_layers": len(layer_types), "layer_types": layer_types,
              "tie_word_embeddings": False}
    return Spec("qwen3_5", {**config, **kw}, seed)


def _qwen35_vl(layer_types: list[str]) -> Spec:
    return Spec("qwen3_5_mm", {
        "text_config": {**_QWEN35_TEXT, "num_hidden_layers": len(layer_types), "layer_types": layer_types,
                        "max_position_embeddings": 4096,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                                            "mrope_interleaved": True}},
        "vision_config": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                              num_position_embeddings=16),
        "image_token_id": 296, "video_token_id": 297,
        "vision_start_token_id": 298, "vision_end_token_id": 299,
        "tie_word_embeddings": False,
    })


# Qwen3.5-MoE text: Qwen3.5's attention and Gated DeltaNet, a sparse MoE block in every layer (16 experts,
# top 4, shared expert with its sigmoid gate)
_MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
            shared_expert_intermediate_size=40)
_QWEN35_MOE_TEXT = {k: v for k, v in _QWEN35_TEXT.items() if k != "intermediate_size"} | _MOE


def _qwen35_moe(layer_types: list[str], seed: int | None = None, **kw: Any) -> Spec:
    config = {**_QWEN35_MOE_TEXT, "num_hidden_layers": len(layer_types), "layer_types": layer_types,
              "tie_word_embeddings": False}
    return Spec("qwen3_5_moe", {**config, **kw}, seed)


def _qwen3_next(**kw: Any) -> Spec:
    config = {**_QWEN35_TEXT, **_MOE, "num_hidden_layers": 3, "layer_types": [LINEAR, FULL, LINEAR],
              "intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [1],
              "norm_topk_prob": True, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}}
    return Spec("qwen3_next", {**config, **kw})


_KIMI = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, linear_head_dim=8,
             linear_num_heads=4, linear_conv_kernel_dim=4, intermediate_size=48, moe_intermediate_size=24,
             num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
             routed_scaling_factor=2.446, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
             max_position_embeddings=8192, **_NO_SPECIAL)


def _kimi(layer_types: list[str], mlp_layer_types: list[str], **kw: Any) -> Spec:
    config = {**_KIMI, "num_hidden_layers": len(layer_types), "layer_types": layer_types,
              "mlp_layer_types": mlp_layer_types}
    return Spec("kimi_linear", {**config, **kw})


# the MoE and Kimi Linear families (models/families.py)
MOE_SPECS: dict[str, Spec] = {
    "qwen35_moe": _qwen35_moe([LINEAR, FULL, LINEAR], seed=15),
    # the multimodal checkpoint layout with the experts rewritten fused (as released checkpoints store
    # them: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and mtp.* tensors
    "qwen35_moe_mm": Spec("qwen3_5_moe_mm", {
        "text_config": {**_QWEN35_MOE_TEXT, "num_hidden_layers": 3, "layer_types": [FULL, LINEAR, LINEAR],
                        "max_position_embeddings": 4096,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                            "mrope_interleaved": True}},
        "vision_config": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                              num_position_embeddings=16),
        "image_token_id": 296, "video_token_id": 297,
        "vision_start_token_id": 298, "vision_end_token_id": 299,
        "tie_word_embeddings": False,
    }, extra_tensors=True),
    # Qwen3-Next: a dense layer (mlp_only_layers), renormalised top-k; GDN projections grouped per key head
    "qwen3_next": _qwen3_next(),
    "qwen3_next_nonorm": _qwen3_next(norm_topk_prob=False, mlp_only_layers=[]),
    # Kimi Linear: KDA, KDA, MLA; a dense first layer, then sparse (sigmoid router, correction bias)
    "kimi": _kimi([LINEAR, LINEAR, FULL], ["dense", "sparse", "sparse"]),
    # group-limited routing: 2 groups of 4 experts, 1 selectable
    "kimi_grouped": _kimi([LINEAR, FULL], ["sparse", "sparse"], num_local_experts=8, n_group=2, topk_group=1),
    # a latent of 32 values (r 24 + dr 8): the native backend's decode attention takes its MLA layers
    "kimi_latent32": _kimi([LINEAR, FULL], ["dense", "sparse"], kv_lora_rank=24),
    # one-layer models (every view exact): KDA, MLA, MoE after Gated DeltaNet, MoE after attention
    "kimi_1l_kda": _kimi([LINEAR], ["sparse"]),
    "kimi_1l_mla": _kimi([FULL], ["sparse"]),
    "qwen35_moe_1l_linear": _qwen35_moe([LINEAR]),
    "qwen35_moe_1l_full": _qwen35_moe([FULL]),
}

TINY_SPECS: dict[str, Spec] = {
    # Llama: default RoPE, GQA 4/2, untied embeddings; seed 14: greedy output is not repetitive (engine tests)
    "llama": _llama(seed=14),
    # llama3 RoPE (original context 16, so the scaling bites within the test lengths), tied embeddings, biases
    "llama3": _llama(
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # YaRN (attention factor != 1 applied to cos/sin), multi-query attention (8 heads, 1 kv head)
    "llama_yarn": _llama(
        num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}),
    # Qwen2: q/k/v biases (none on o_proj), RoPE theta 1e6 as Qwen2.5's, GQA 4/2, untied embeddings
    "qwen2": _qwen2(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen2 as the small Qwen2.5 checkpoints: tied embeddings, 7 heads sharing one kv head, 3 layers
    "qwen2_tied": _qwen2(hidden_size=56, num_attention_heads=7, num_key_value_heads=1, num_hidden_layers=3,
                         tie_word_embeddings=True),
    # Qwen3: q/k norm, odd head counts (6 heads, 2 kv heads, head_dim 16 != hidden/heads), 3 layers
    "qwen3": _qwen3(),
    # Qwen3.5 text: mixed linear/full layers (Gated DeltaNet + gated full attention), partial rotary
    # (default 0.25), output gate, GQA in GDN
    "qwen35": _qwen35([LINEAR, FULL, LINEAR], seed=13),
    # Qwen3.5 text with linear attention only (no KV pool use at all)
    "qwen35_linear": _qwen35([LINEAR, LINEAR]),
    # one-layer models: every view is exact (a block's stored memory does not depend on its view)
    "llama_1l": _llama(num_hidden_layers=1, initializer_range=0.2),
    "qwen3_1l": _qwen3(num_hidden_layers=1),
    "qwen35_1l_linear": _qwen35([LINEAR]),
    "qwen35_1l_full": _qwen35([FULL]),
    # Qwen3.5 in the multimodal checkpoint layout (model.language_model.*, model.visual.*, mtp.*),
    # multimodal RoPE parameters (interleaved mrope sections), tied embeddings declared at the top level
    "qwen35_mm": Spec("qwen3_5_mm", {
        "text_config": {**_QWEN35_TEXT, "num_hidden_layers": 3, "layer_types": [FULL, LINEAR, LINEAR],
                        "max_position_embeddings": 4096,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                            "mrope_interleaved": True}},
        "vision_config": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                              num_position_embeddings=16),
        "image_token_id": 296, "video_token_id": 297,
        "vision_start_token_id": 298, "vision_end_token_id": 299,
        "tie_word_embeddings": True,
    }, extra_tensors=True),
    **MOE_SPECS,
    # Qwen3.5 multimodal for the vision tests: rotary dim 16 with sections [4, 2, 2] (each axis owns at
    # least two frequencies, so a wrong position shows), a hybrid stack and a one-layer one
    "qwen35_vl": _qwen35_vl([FULL, LINEAR, FULL]),
    "qwen35_vl_1l": _qwen35_vl([FULL]),
    "qwen35_vl_1l_linear": _qwen35_vl([LINEAR]),
    # Qwen3-VL: the Qwen3 decoder with full-width multimodal RoPE, a vision tower with DeepStack features
    # added after the first decoder layers
    "qwen3_vl": Spec("qwen3_vl", {
        "text_config": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                            max_position_embeddings=4096,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
        "vision_config": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                              num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        "image_token_id": 296, "video_token_id": 297,
        "vision_start_token_id": 298, "vision_end_token_id": 299,
        "tie_word_embeddings": False,
    }),
}


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Give trivially initialised weights values that matter.

    Norm weights (Qwen3.5's are zero-centred, init 0; others init 1) and biases (init 0) get noise. GDN
    decays are made mild (A = exp(A_log) in [0.02, 0.3] instead of up to 16) so the recurrent state carries
    information across many tokens and blocks instead of forgetting it within one token.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
        elif "norm" in name or name.endswith("bias"):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # MoE routers: spread
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # Kimi's selection bias (zero-initialised)
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def _build_reference(spec: Spec, seed: int) -> torch.nn.Module:
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_mm": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "qwen3_5_moe_mm": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "kimi_linear": (tf.KimiLinearConfig, tf.KimiLinearForCausalLM),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
    }
    config_cls, model_cls = classes[spec.family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**copy.deepcopy(spec.config))).eval()
    perturb(model, seed)
    if spec.family in ("qwen3_5_moe", "qwen3_5_moe_mm", "qwen3_next", "kimi_linear"):
        # the experts path whose dtype chain cothink's matches
        model.set_experts_implementation("grouped_mm")
    return model


def _fuse_experts_on_disk(state: dict[str, torch.Tensor]) -> None:
    """Rewrite per-expert tensors `<p>.experts.<e>.{gate,up,down}_proj.weight` as the fused pair
    `<p>.experts.gate_up_proj` [E, 2I, H] and `<p>.experts.down_proj` [E, H, I] (released Qwen3.5-MoE)."""
    prefixes = sorted({k.split(".experts.")[0] for k in state if ".experts.0.gate_proj.weight" in k})
    for p in prefixes:
        e = 0
        gate_up, down = [], []
        while f"{p}.experts.{e}.gate_proj.weight" in state:
            g, u, d = (state.pop(f"{p}.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
            gate_up.append(torch.cat((g, u)))
            down.append(d)
            e += 1
        state[f"{p}.experts.gate_up_proj"] = torch.stack(gate_up)
        state[f"{p}.experts.down_proj"] = torch.stack(down)


def _add_fake_tensors(folder: Path) -> None:
    """Add multi-token-prediction tensors (mtp.*) to the checkpoint, as real Qwen3.5 checkpoints have
    (and store a MoE checkpoint's experts fused, as released Qwen3.5-MoE checkpoints do)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    _fuse_experts_on_disk(state)
    assert any(k.startswith("model.language_model.") for k in state), sorted(state)[:5]
    assert any(k.startswith("model.visual.") for k in state), sorted(state)[:5]
    gen = torch.Generator().manual_seed(7)
    state["mtp.fc.weight"] = torch.randn(64, 128, generator=gen)
    state["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(128, 64, generator=gen)
    state["mtp.norm.weight"] = torch.randn(64, generator=gen)
    save_file(state, str(path), metadata={"format": "pt"})


def _bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def make_tokenizer():
    """A byte-level tokenizer of exactly VOCAB ids: every id decodes, every string encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_tokens(WORDS)
    assert len(fast) == VOCAB
    return fast


@dataclass
class TinyModel:
    name: str
    spec: Spec
    ref: torch.nn.Module  # the transformers model (fp32, eval)
    folder: Path  # checkpoint + byte-level tokenizer

    def runner(self, **limits: Any) -> ModelRunner:
        return cothink.load_model(self.folder, **limits)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Reference logits [len(ids), vocab] of one sequence (no cache)."""
        return self.ref(torch.tensor([ids]), use_cache=False).logits[0].float()

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        """`generate(do_sample=False)` continuation of n tokens."""
        if LINEAR_ONLY_GENERATE_BROKEN and FULL not in self.spec.config.get("layer_types", [FULL]):
            # transformers' cache for a model without attention layers fails in generate (get_seq_length);
            # greedy decoding by full recomputation is the same function.
            seq = list(ids)
            for _ in range(n):
                seq.append(int(self.logits(seq)[-1].argmax()))
            return seq[len(ids):]
        out = self.ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()


class Zoo:
    """zoo(name) -> TinyModel of TINY_SPECS[name]; built and saved once per process (thread-safe)."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._models: dict[str, TinyModel] = {}
        self._lock = threading.Lock()

    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="cothink-tiny-models-"))
            atexit.register(shutil.rmtree, self._root, True)
        return self._root

    def __call__(self, name: str) -> TinyModel:
        with self._lock:
            if name not in self._models:
                spec = TINY_SPECS[name]
                seed = spec.seed if spec.seed is not None else zlib.crc32(name.encode()) % 10_000
                ref = _build_reference(spec, seed)
                folder = self.root() / name
                ref.save_pretrained(folder)
                make_tokenizer().save_pretrained(folder)
                if spec.extra_tensors:
                    _add_fake_tensors(folder)
                self._models[name] = TinyModel(name, spec, ref, folder)
            return self._models[name]


ZOO = Zoo()


_VISION_PIXELS = dict(patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                      image_std=[0.5] * 3, min_pixels=64)


def tiny_vision_folder(name: str) -> Path:
    """A tiny multimodal checkpoint of the zoo with small pixel budgets (an image is a few merged
    tokens: at most 40 x 40 pixels; a clip 4 x 24 x 24 pixels over all its frames)."""
    folder = ZOO.root() / f"{name}-pixels"
    if not folder.exists():
        tmp = ZOO.root() / f"{name}-pixels.tmp"
        shutil.copytree(ZOO(name).folder, tmp, dirs_exist_ok=True)
        (tmp / "preprocessor_config.json").write_text(json.dumps({**_VISION_PIXELS, "max_pixels": 40 * 40}))
        (tmp / "video_preprocessor_config.json").write_text(
            json.dumps({**_VISION_PIXELS, "max_pixels": 4 * 24 * 24}))
        # no special tokens (loading would otherwise add an end-of-text token outside the vocabulary)
        config = json.loads((tmp / "tokenizer_config.json").read_text())
        config.update(eos_token=None, pad_token=None, unk_token=None, bos_token=None)
        (tmp / "tokenizer_config.json").write_text(json.dumps(config))
        tmp.rename(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model() -> Zoo:
    """tiny_model(name) -> TinyModel; built and saved once per session."""
    return ZOO


# Largest error seen per (test group, model name); printed in the terminal summary (tests/conftest.py).
ERRORS: dict[tuple[str, str], float] = {}


def keep_largest_error(group: str, name: str, err: float) -> float:
    """Keep err for the session summary if it is the largest of its (group, model name); -> err."""
    ERRORS[(group, name)] = max(ERRORS.get((group, name), 0.0), err)
    return err


@pytest.fixture(scope="session")
def record_error():
    """record_error(group, model_name, err) -> err: keep the largest error for the session summary."""
    return keep_largest_error


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Kept for modules that import it by name: tests/conftest.py already pins one thread per test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- tiny configs of the layer-level tests (MoE, KDA, MLA) --------------------------------------------
def tiny_kimi_config(**overrides: Any):
    """A tiny transformers KimiLinearConfig (hidden 32): layer 0 KDA, layer 1 MLA with a sparse MLP."""
    import transformers as tf

    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=[LINEAR, FULL],
        mlp_layer_types=["dense", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_local_experts=8,
        num_experts_per_tok=4,
        rms_norm_eps=1e-5,
    )
    return tf.KimiLinearConfig(**(base | overrides))


def tiny_hybrid_moe(**overrides: Any) -> dict[str, Any]:
    """Keywords of a tiny Qwen3.5-MoE / Qwen3-Next text config (hidden 32, 16 experts): a GDN layer then a
    full-attention one."""
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=[LINEAR, FULL],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=20,
        num_experts=16,
    )
    return base | overrides


# ---- runners and engines over the zoo ------------------------------------------------------------------
def tiny_folder(kind: str) -> Path:
    """A saved tiny checkpoint (with the byte-level tokenizer) of TINY_SPECS[kind]; built once per process."""
    return ZOO(kind).folder


def load_runner(kind: str, **limits: Any) -> ModelRunner:
    return cothink.load_model(tiny_folder(kind), **limits)


def fresh_runner(runner: ModelRunner, **limits: Any) -> ModelRunner:
    """A new runner (empty memory) sharing `runner`'s weights and tokenizer."""
    limits.setdefault("kv_tokens", 8192)
    return ModelRunner(runner.model, runner.tokenizer, **limits)


def make_engine(kind_or_runner: str | ModelRunner, *, kv_tokens: int = 16384, page_size: int = 16,
                **limits: Any) -> Engine:
    """An engine over a tiny model (by kind) or over a fresh runner sharing a loaded model's weights."""
    from cothink.runtime.engine import Engine, EngineLimits
    from cothink.scheduler.policy import SchedulerConfig

    sched = {k: limits.pop(k) for k in list(limits) if k in SchedulerConfig.__dataclass_fields__}
    runner_limits = {k: limits.pop(k) for k in list(limits) if k in ("max_context",)}
    if isinstance(kind_or_runner, str):
        runner = load_runner(kind_or_runner, kv_tokens=kv_tokens, page_size=page_size, **runner_limits)
    else:
        runner = fresh_runner(kind_or_runner, kv_tokens=kv_tokens, page_size=page_size, **runner_limits)
    return Engine(runner, EngineLimits(scheduler=SchedulerConfig(**sched), **limits))


def smollm2_runner(**limits: Any) -> ModelRunner:
    """The embedded SmolLM2-135M-Instruct (converted into the cothink cache on first use)."""
    limits.setdefault("kv_tokens", 4096)
    return cothink.load_model("smollm2", **limits)


def ids(n: int, seed: int | random.Random, low: int = 0, high: int = VOCAB) -> list[int]:
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


async def until(predicate, timeout: float = 30.0) -> None:
    """Yield to the event loop (so engine steps run) until predicate() holds, then return in the same
    loop turn as the check that held: what the caller does next sees the state it saw. (A wait_for
    around a polling task returned a turn later: a step seen running could end meanwhile, and a call
    meant to land mid-step landed after it.)"""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0)


def fast_and_eager(
    zoo: Zoo, name: str, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[TinyModel, ModelRunner, ModelRunner]:
    """(tiny model, fast-path runner, eager runner with torch attention) for `name`, with cothink's C kernels
    on (kernels "native"; the test is skipped where they did not build) or off ("torch")."""
    from cothink.ops import native

    if kernels == "native" and not native.available():
        pytest.skip("cothink's C kernels did not build here")
    monkeypatch.setattr(native, "ENABLED", kernels == "native")
    tm = zoo(name)
    return tm, tm.runner(), tm.runner(fast=False, attention_backend="torch")


def prefill_then_decode(runner: ModelRunner, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits of `ids` written into a fresh block: ids[:prefill] in one step, then one token per step."""
    block = runner.new_block()
    first = runner.extend(block, ids[:prefill])
    return torch.cat([first, *(runner.extend(block, [t]) for t in ids[prefill:])])


def write_blocks_with_random_views(
    runner: ModelRunner, rng: random.Random, lengths: list[int]
) -> list[Block]:
    """Blocks of `lengths` tokens written one by one, each reading a random permutation of some earlier
    blocks; blocks of 10 tokens or more in two steps, each with its own view."""
    blocks = []
    for i, n in enumerate(lengths):
        block = runner.new_block(f"blk{i}")
        ids = random_ids(n, rng)
        cut = [0, n] if n < 10 else [0, n // 3, n]
        for a, b in zip(cut, cut[1:]):
            earlier = rng.sample(blocks, rng.randint(0, min(4, len(blocks))))
            runner.extend(block, ids[a:b], view=earlier + [block])
        blocks.append(block)
    return blocks


def count_native_rows(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Wrap the C kernel `cothink.ops.native.<name>` (the real kernel still runs); the returned list gets
    the rows (first dimension of the first argument) of every call."""
    from cothink.ops import native

    calls: list[int] = []
    real = getattr(native, name)

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(native, name, counting)
    return calls


def count_fused_decode_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every fused decode step (`count_native_rows` of `decode_layers`)."""
    return count_native_rows(monkeypatch, "decode_layers")


# ---- recording an engine's steps and replaying them one item at a time --------------------------------
@dataclass
class Recorder:
    """Tracks blocks of an engine: after every step, the length of each tracked block.

    `views[writer_name]` is the view the tracked block `writer_name` is written under (the block is its
    last element). Attach before the tracked blocks are written (they must be empty then), and make no
    changes between steps other than engine work (no truncate), so that the lengths after step s-1 are
    the lengths every item of step s saw.
    """

    engine: Engine
    views: dict[str, list[Block]]
    blocks: list[Block] = field(default_factory=list)
    steps: list[tuple[StepRecord, dict[str, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: dict[str, Block] = {}
        for view in self.views.values():
            for b in view:
                seen.setdefault(b.name, b)
        self.blocks = list(seen.values())
        assert all(len(b) == 0 for b in self.blocks), "attach the recorder before writing tracked blocks"
        self.engine.step_listeners.append(self._on_step)

    def lengths(self) -> dict[str, int]:
        return {b.name: len(b) for b in self.blocks}

    def _on_step(self, record: StepRecord) -> None:
        self.steps.append((record, self.lengths()))

    def step_of(self, name: str, position: int) -> int:
        """Index into `steps` of the step that wrote token `position` of block `name`."""
        for s, (_, after) in enumerate(self.steps):
            if after[name] > position:
                return s
        raise AssertionError(f"token {position} of {name} was never written")


@dataclass
class Replay:
    runner: ModelRunner
    blocks: dict[str, Block]
    # per writer block: (start position, tokens, logits 'all') of every replayed write, in order
    writes: dict[str, list[tuple[int, list[int], torch.Tensor]]]
    before: list[dict[str, int]]  # lengths at the start of each recorded step

    def logits_before(self, name: str, position: int) -> torch.Tensor:
        """Logits (under the block's writer view) that predicted token `position` of block `name`."""
        for start, toks, logits in self.writes[name]:
            row = position - start - 1  # row j of a write predicts the token after its j-th token
            if 0 <= row < len(toks):
                return logits[row]
        raise AssertionError(f"no replayed logits before token {position} of {name}")

    def view_logits(self, view_names: list[str], lengths: dict[str, int]) -> torch.Tensor:
        """Logits after the content of `view_names` at `lengths` (its last non-empty block's last token is
        recomputed in a scratch block that reads the rest of the view)."""
        prefix = [n for n in view_names if lengths[n]]
        last = prefix[-1]
        prefix = view_names[: view_names.index(last) + 1]
        scratch = self.runner.new_block("replay-scratch")
        read = [lengths[n] for n in prefix]
        read[-1] -= 1
        item = StepItem(scratch, [self.blocks[last].tokens[lengths[last] - 1]],
                        [*(self.blocks[n] for n in prefix), scratch], "last", read)
        out = self.runner.step([item])[0][-1]
        self.runner.free(scratch)
        return out


def replay(rec: Recorder, runner: ModelRunner) -> Replay:
    """Rebuild the recorded blocks on `runner` (fresh blocks), one item per forward pass, each item reading
    every other block as it was at the start of its recorded step."""
    blocks = {b.name: runner.new_block(b.name) for b in rec.blocks}
    writes: dict[str, list] = {name: [] for name in rec.views}
    prev = {b.name: 0 for b in rec.blocks}
    before = []
    for _, after in rec.steps:
        before.append(dict(prev))
        for name, length in after.items():
            if length == prev[name]:
                continue
            assert length > prev[name], f"block {name} shrank between steps"
            assert name in rec.views, f"untracked writer of block {name}"
            view = rec.views[name]
            src = next(b for b in rec.blocks if b.name == name)
            toks = src.tokens[prev[name]:length]
            item = StepItem(blocks[name], toks, [blocks[b.name] for b in view], "all",
                            [prev[b.name] for b in view[:-1]])
            writes[name].append((prev[name], toks, runner.step([item])[0]))
        prev = after
    return Replay(runner, blocks, writes, before)


def check_greedy(rec: Recorder, rep: Replay, name: str, coroutine: str, start: int, count: int) -> list[int]:
    """Check that tokens start..start+count-1 of block `name`, generated greedily by `coroutine` in one
    generation, are what the replay predicts: each is the argmax of the logits after the view as the
    engine saw it when sampling that token. Returns the positions that disagree (empty when all agree).

    Token k >= 1 was sampled from the logits of the step that wrote token k-1. The first token was sampled
    from the logits after the view at the generation's first step (a scratch "peek" step, or the step that
    wrote it when the view's last write had left those logits cached; tests submit generations while the
    view's other writers are quiet, so the view is the same at submission and at that first step).
    """
    block = next(b for b in rec.blocks if b.name == name)
    view = [b.name for b in rec.views[name]]
    after = rec.step_of(name, start - 1) if start else -1
    first = next(s for s, (r, _) in enumerate(rec.steps)
                 if s > after and any(i.coroutine == coroutine for i in r.items))
    wrong = []
    for pos in range(start, start + count):
        logits = rep.view_logits(view, rep.before[first]) if pos == start else rep.logits_before(name, pos)
        if int(logits.argmax()) != block.tokens[pos]:
            wrong.append(pos)
    return wrong


# ---- snapshots for "a failed call changes nothing" -----------------------------------------------------
def logits_after(engine: Engine, view: list[Block], token: int) -> torch.Tensor:
    """The logits after reading `token` behind `view`, in a scratch block (between steps)."""
    runner = engine.runner
    scratch = runner.new_block("scratch")
    try:
        return runner.extend(scratch, [token], [*view, scratch], logits="last")[0]
    finally:
        runner.free(scratch)


def snapshot(engine: Engine, blocks: list[Block]) -> dict[str, Any]:
    mem = engine.memory()
    return {
        "blocks": [(b.name, len(b), list(b.tokens), b.version, list(b.pages), b.freed) for b in blocks],
        "free_pages": mem.free_pages,
        "live_blocks": mem.live_blocks,
        "used_pages": mem.used_pages,
    }


# ---- server helpers: a tiny chat model with SmolLM2's tokenizer, a real server on loopback ---------------
_CHAT_DIR: list[Path] = []
_CHAT_LOCK = threading.Lock()


def smollm2_dir() -> Path:
    from cothink.models.hub import prepare_model

    return Path(prepare_model("smollm2"))


def tiny_chat_model_dir() -> Path:
    """A 2-layer, 64-wide random Llama with SmolLM2's tokenizer (vocab 49152), saved once per process."""
    with _CHAT_LOCK:
        if _CHAT_DIR:
            return _CHAT_DIR[0]
        import transformers as tf

        tok = tf.AutoTokenizer.from_pretrained(str(smollm2_dir()))
        cfg = tf.LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=None,
        )
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg).eval()
        folder = Path(tempfile.mkdtemp(prefix="cothink-tiny-chat-"))
        atexit.register(shutil.rmtree, folder, True)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        _CHAT_DIR.append(folder)
        return folder


def tiny_engine(**limits: Any) -> Engine:
    return cothink.Engine.from_pretrained(tiny_chat_model_dir(), **limits)


@contextlib.contextmanager
def running_server(engine, settings=None, **kwargs: Any) -> Iterator[Any]:
    """Yield a started BackgroundServer for create_app(engine, settings); stop it gracefully after."""
    from cothink.server import BackgroundServer, ServerSettings, create_app

    app = create_app(engine, settings or ServerSettings(model_name="tiny"), **kwargs)
    server = BackgroundServer(app).start()
    try:
        yield server
    finally:
        assert server.stop(30), "the server did not shut down within 30 s"


def wait_for(predicate, timeout: float = 20.0, poll: float = 0.02) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def abandoned_request(server, path: str, body: dict, started, headers: dict | None = None) -> None:
    """POST `body` to `path` over a raw socket and close the connection once `started()` (called on
    the server's event loop) holds: a client that gives up while its request is being served.

    A raw socket, because an HTTP client blocks until response headers arrive, which a non-streaming
    request sends only at its end; closing on an observed server state rather than after a client
    timeout keeps the test independent of the machine's speed.
    """
    url = httpx.URL(server.url)
    raw = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {url.host}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines += [f"Content-Length: {len(raw)}", "", ""]
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode() + raw)
        assert wait_for(lambda: server.call(started), poll=0.001), f"{path}: the work never started"


def sse_events(response) -> list[Any]:
    """Parse an SSE response body into JSON objects ('[DONE]' kept as the string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
