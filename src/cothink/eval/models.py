"""The models the evaluation runs on, loaded once per run and shared by every suite.

- ``smollm2``: the embedded SmolLM2-135M-Instruct (Llama architecture, attention only).
- ``qwen35-random``: a random-weight Qwen3.5 hybrid (Gated DeltaNet + full attention, 3:1) with a
  realistic-but-small shape, built with transformers once and cached. Its vocabulary is made equal
  to SmolLM2's (49152) and SmolLM2's tokenizer is copied next to it, so the text suites run on it
  too (its text is noise: its numbers measure cost and exactness, never quality).

A suite gets a fresh engine over the already loaded weights with `ModelHandle.engine(**limits)`:
each engine has its own KV pool and block store, the weights are shared.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MODEL_NAMES = ("smollm2", "qwen35-random")

# The random Qwen3.5 hybrid: stated in the report.
QWEN35_RANDOM_SHAPE: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,  # partial rotary 0.25: 16 rotary channels
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=32768,
    initializer_range=0.02,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
QWEN35_RANDOM_SEED = 1234
_QWEN_FOLDER = "qwen35-random-h512-l8-v49152-s1234"


def describe_qwen35_random() -> str:
    s = QWEN35_RANDOM_SHAPE
    lt = s["layer_types"]
    return (
        f"random-weight Qwen3.5 hybrid (transformers Qwen3_5ForCausalLM, seed {QWEN35_RANDOM_SEED}): "
        f"hidden {s['hidden_size']}, {s['num_hidden_layers']} layers "
        f"({lt.count('linear_attention')} Gated DeltaNet : {lt.count('full_attention')} full attention, "
        f"pattern {'/'.join('L' if t == 'linear_attention' else 'F' for t in lt)}), "
        f"attention {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads x {s['head_dim']} "
        f"(partial rotary 0.25), GDN {s['linear_num_key_heads']} key / {s['linear_num_value_heads']} value "
        "heads "
        f"x {s['linear_key_head_dim']}, conv {s['linear_conv_kernel_dim']}, MLP {s['intermediate_size']}, "
        f"vocab {s['vocab_size']} (SmolLM2's tokenizer), tied embeddings"
    )


def eval_cache_dir() -> Path:
    from cothink.models.hub import cache_dir

    return cache_dir() / "eval"


def build_qwen35_random(folder: Path | None = None, tokenizer_from: str | Path | None = "smollm2") -> Path:
    """Build (once) and return the folder of the random-weight Qwen3.5 hybrid."""
    import transformers as tf

    folder = Path(folder) if folder is not None else eval_cache_dir() / _QWEN_FOLDER
    marker = folder / "cothink_eval_model.json"
    if marker.exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(QWEN35_RANDOM_SEED)
    cfg = tf.Qwen3_5TextConfig(**QWEN35_RANDOM_SHAPE)
    model = tf.Qwen3_5ForCausalLM(cfg).eval()
    _perturb(model, QWEN35_RANDOM_SEED)
    with _quiet():
        model.save_pretrained(tmp)
    if tokenizer_from is not None:
        from cothink.models.hub import resolve_model_path

        src = resolve_model_path(tokenizer_from)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "special_tokens_map.json",
        ):
            if (src / name).exists():
                shutil.copy(src / name, tmp / name)
    (tmp / "cothink_eval_model.json").write_text(
        json.dumps({"shape": QWEN35_RANDOM_SHAPE, "seed": QWEN35_RANDOM_SEED})
    )
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give trivially initialised weights values that matter (zero-centred norms, GDN decays), as the
    test suite's tiny models do: mild decays so the recurrent state carries information across blocks."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
        elif "norm" in name or name.endswith("bias"):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


@dataclass
class ModelHandle:
    """A loaded model: weights and tokenizer, shared by the engines the suites create."""

    key: str  # 'smollm2', 'qwen35-random' or a folder
    folder: Path
    runner: Any  # the ModelRunner loaded first; its weights are reused
    dtype: torch.dtype
    description: str
    load_s: float
    max_context: int
    info: dict[str, Any] = field(default_factory=dict)
    # limits every engine of this handle takes unless a suite overrides them (e.g. a step policy under test)
    limits: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def config(self) -> Any:
        return self.runner.config

    @property
    def is_hybrid(self) -> bool:
        return bool(self.runner.config.linear_layers)

    def new_runner(self, **memory: Any) -> Any:
        """A fresh ModelRunner (own pool and store) over the same weights."""
        from cothink.execution.runner import ModelRunner

        memory.setdefault("max_context", self.max_context)
        return ModelRunner(self.runner.model, self.runner.tokenizer, vision=self.runner.vision, **memory)

    def engine(self, **limits: Any) -> Any:
        """A fresh Engine over the shared weights; limits as in Engine.from_pretrained."""
        from cothink.runtime.engine import Engine, EngineLimits
        from cothink.scheduler.policy import SchedulerConfig

        limits = {**self.limits, **limits}
        memory_keys = {"kv_tokens", "page_size", "max_context", "dense_summary_min_tokens"}
        sched_keys = set(SchedulerConfig.__dataclass_fields__)
        runner = self.new_runner(**{k: v for k, v in limits.items() if k in memory_keys})
        sched = SchedulerConfig(**{k: v for k, v in limits.items() if k in sched_keys})
        rest = {k: v for k, v in limits.items() if k not in memory_keys | sched_keys}
        return Engine(runner, EngineLimits(scheduler=sched, **rest))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of a chat prompt ending with the assistant's turn opener."""
        from cothink.models.text import chat_prompt_ids

        return chat_prompt_ids(self.tokenizer, user, system=system)


def load(
    key: str, dtype: torch.dtype = torch.float32, max_context: int = 20000, quantize: str | None = None
) -> ModelHandle:
    """Load 'smollm2', 'qwen35-random' or a local folder (which must have a tokenizer); `quantize`
    as in load_model ("int8" refuses model families it does not support)."""
    from cothink.execution.runner import load_model
    from cothink.models.hub import EMBEDDED_MODELS, resolve_model_path

    if key == "qwen35-random":
        folder = build_qwen35_random()
        description = describe_qwen35_random()
    else:
        folder = resolve_model_path(key)
        embedded = EMBEDDED_MODELS.get(key)
        if key == "smollm2":
            description = "SmolLM2-135M-Instruct (embedded; Llama architecture, 30 layers, attention only)"
        elif embedded is not None:
            description = (f"{embedded.folder} (embedded: a {embedded.model_type} checkpoint de-quantised "
                           f"from its shipped {embedded.source.file})")
        else:
            description = f"model folder {folder}"
    t0 = time.perf_counter()
    # A minimal pool for the loading runner: the suites make their own engines.
    runner = load_model(folder, "cpu", dtype, kv_tokens=16, max_context=max_context, quantize=quantize)
    load_s = time.perf_counter() - t0
    if runner.tokenizer is None:
        raise ValueError(f"model {key!r} has no tokenizer; the evaluation needs one")
    cfg = runner.config
    hf = cfg.hf_text_config
    info = {
        "layers": getattr(hf, "num_hidden_layers", None),
        "attention_layers": len(cfg.attention_layers),
        "linear_layers": len(cfg.linear_layers),
        "hidden_size": getattr(hf, "hidden_size", None),
        "vocab_size": cfg.vocab_size,
        "trained_context": getattr(hf, "max_position_embeddings", None),
        "parameters": sum(p.numel() for p in runner.model.parameters()),
    }
    if key not in MODEL_NAMES:  # a folder: name it by its last component (used in file names)
        key = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(key).name) or "model"
    return ModelHandle(key, folder, runner, dtype, description, load_s, max_context, info)


# ---- tiny models (tests, smoke runs) ------------------------------------------------------------

_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(folder: str | Path, *, hybrid: bool = False, seed: int = 0, vocab: int = 512) -> Path:
    """A tiny random model with a small byte-level BPE tokenizer and a chat template, for fast tests.

    hybrid=False: Llama (2 attention layers); hybrid=True: Qwen3.5 (Gated DeltaNet + full attention)."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from cothink.eval.workload import document_text, problems

    folder = Path(folder)
    if (folder / "cothink_eval_model.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        document_text(seed, 200),
        *(p.prompt for p in problems(seed, 50)),
        *["The quick brown fox jumps over the lazy dog. Answer: yes no"] * 50,
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = _TINY_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    n_vocab = len(fast)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=n_vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if hybrid:
        cfg = tf.Qwen3_5TextConfig(
            **common,
            num_hidden_layers=2,
            head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        model = tf.Qwen3_5ForCausalLM(cfg).eval()
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_hidden_layers=2)).eval()
    _perturb(model, seed)
    with _quiet():
        model.save_pretrained(folder)
    (folder / "cothink_eval_model.json").write_text(
        json.dumps({"tiny": True, "hybrid": hybrid, "seed": seed})
    )
    return folder


class _quiet:
    """Silence transformers' progress bars while saving."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        if self._was:
            hf_logging.enable_progress_bar()
