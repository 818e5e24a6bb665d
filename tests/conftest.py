"""Shared fixtures: tiny random-weight Hugging Face models saved once per session, and helpers.

`tiny_model(name)` builds the transformers reference model of a spec in TINY_SPECS (seeded, fp32),
perturbs the weights that a fresh init leaves trivial (zero-centred norms, biases, GDN decays), saves it
with `save_pretrained` to a session temp folder and returns (reference model, folder). Models are built
lazily, on first use, so running one test file only builds what it needs.
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# tests/reference.py is imported as `reference` whether or not tests/ is a package
sys.path.insert(0, str(Path(__file__).resolve().parent))

# ---- quiet transformers: kernel fallback notices, progress bars, generation hints -------------
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


def _silence_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


_silence_transformers()

VOCAB = 300
# transformers 5.23: generate() on a Qwen3.5 model with only linear-attention layers raises ValueError
# ("`get_seq_length` can only be called on Attention layers") when it builds the cache.
LINEAR_ONLY_GENERATE_BROKEN = True
FULL, LINEAR = "full_attention", "linear_attention"
_NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclass(frozen=True)
class Spec:
    """A tiny model: which transformers classes build it and with which config keywords."""

    family: str  # llama | qwen3 | qwen3_5 | qwen3_5_mm
    config: dict[str, Any]
    extra_tensors: bool = False  # add fake mtp.* tensors to the safetensors file


def _llama(**kw: Any) -> Spec:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                max_position_embeddings=4096, tie_word_embeddings=False, **_NO_SPECIAL)
    return Spec("llama", {**base, **kw})


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
                    initializer_range=0.1, max_position_embeddings=4096, **_NO_SPECIAL)


def _qwen35(layer_types: list[str], **kw: Any) -> Spec:
    config = {**_QWEN35_TEXT, "num_hidden_layers": len(layer_types), "layer_types": layer_types}
    return Spec("qwen3_5", {**config, **kw})


TINY_SPECS: dict[str, Spec] = {
    # Llama: default RoPE, GQA 4/2, untied embeddings
    "llama": _llama(),
    # llama3 RoPE (original context 16, so the scaling bites within the test lengths), tied embeddings, biases
    "llama3": _llama(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # YaRN (attention factor != 1 applied to cos/sin), multi-query attention (8 heads, 1 kv head)
    "llama_yarn": _llama(
        num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}),
    # Qwen3: q/k norm, odd head counts (6 heads, 2 kv heads, head_dim 16 != hidden/heads), 3 layers
    "qwen3": _qwen3(),
    # Qwen3.5 text: mixed linear/full layers, partial rotary (default 0.25), output gate, GQA in GDN
    "qwen35": _qwen35([LINEAR, FULL, LINEAR]),
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
}


def _build_reference(spec: Spec, seed: int) -> torch.nn.Module:
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_mm": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
    }
    config_cls, model_cls = classes[spec.family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**copy.deepcopy(spec.config))).eval()
    _perturb(model, seed)
    return model


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give trivially initialised weights values that matter.

    Norm weights (Qwen3.5's are zero-centred, init 0; others init 1) and biases (init 0) get noise. GDN
    decays are made mild (A = exp(A_log) in [0.02, 0.3] instead of up to 16) so the recurrent state carries
    information across many tokens and blocks instead of forgetting it within one token.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
        elif "norm" in name or name.endswith("bias"):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _add_fake_tensors(folder: Path) -> None:
    """Add multi-token-prediction tensors (mtp.*) to the checkpoint, as real Qwen3.5 checkpoints have."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    assert any(k.startswith("model.language_model.") for k in state), sorted(state)[:5]
    assert any(k.startswith("model.visual.") for k in state), sorted(state)[:5]
    gen = torch.Generator().manual_seed(7)
    state["mtp.fc.weight"] = torch.randn(64, 128, generator=gen)
    state["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(128, 64, generator=gen)
    state["mtp.norm.weight"] = torch.randn(64, generator=gen)
    save_file(state, str(path), metadata={"format": "pt"})


@dataclass
class TinyModel:
    name: str
    spec: Spec
    ref: torch.nn.Module  # the transformers model (fp32, eval)
    folder: Path

    def runner(self, **limits: Any):
        import cothink

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


class _Zoo:
    def __init__(self, root: Path):
        self.root = root
        self._models: dict[str, TinyModel] = {}

    def __call__(self, name: str) -> TinyModel:
        if name not in self._models:
            spec = TINY_SPECS[name]
            ref = _build_reference(spec, seed=zlib.crc32(name.encode()) % 10_000)  # stable per name
            folder = self.root / name
            ref.save_pretrained(folder)
            if spec.extra_tensors:
                _add_fake_tensors(folder)
            self._models[name] = TinyModel(name, spec, ref, folder)
        return self._models[name]


_MY_MODULES = ("test_models_", "test_views_")


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest):
    """Tiny models run much faster on one thread: OpenMP spin-waits dominate (30x under CPU contention)."""
    if not request.module.__name__.rsplit(".", 1)[-1].startswith(_MY_MODULES):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> _Zoo:
    """tiny_model(name) -> TinyModel; built and saved once per session."""
    return _Zoo(tmp_path_factory.mktemp("tiny_models"))


# Largest error seen per (test group, model name); printed in the terminal summary.
_ERRORS: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="session")
def record_error():
    """record_error(group, model_name, err) -> err: keep the largest error for the session summary."""

    def record(group: str, name: str, err: float) -> float:
        _ERRORS[(group, name)] = max(_ERRORS.get((group, name), 0.0), err)
        return err

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ERRORS:
        return
    terminalreporter.section("max |logit error| per model")
    for (group, name), err in sorted(_ERRORS.items()):
        terminalreporter.write_line(f"{group:<28} {name:<18} {err:.2e}")
