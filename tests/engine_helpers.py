"""Helpers for the engine tests (tests/test_engine_*.py): tiny models, fresh runners, step recording, replay.

Tiny models are random-weight transformers checkpoints saved once per process to a temporary folder, each
with a tiny byte-level tokenizer (256 byte tokens + 44 whole-word tokens, vocabulary 300) so that text
input, decoded output, stop strings and probes work without the real model. The tokenizer has no EOS.

`Recorder` + `replay` reproduce what an engine did, one item at a time, on a fresh runner: the recorder
notes, after every engine step, the length of every tracked block; the replay writes each block's new
tokens with `runner.step([StepItem(..., read_lengths=<lengths at step start>)])`, which is exactly the
visibility the step semantics promise (BRIEF §2: each item reads the view as it was at the start of the
step plus its own tokens).
"""

from __future__ import annotations

import asyncio
import atexit
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import cothink
from cothink.execution.runner import ModelRunner
from cothink.execution.step import StepItem
from cothink.memory.block import Block
from cothink.runtime.engine import Engine, EngineLimits, StepRecord
from cothink.scheduler.policy import SchedulerConfig

VOCAB = 300
ATOL = 1e-5  # fp32 logits: batched vs alone
FULL, LINEAR = "full_attention", "linear_attention"
# whole-word tokens (ids 256..299): probes can use single-token choices " yes" / " no"
WORDS = [" yes", " no", "Answer:", " maybe"] + [f"<w{i}>" for i in range(40)]
YES, NO = 256, 257

_ROOT: Path | None = None
_FOLDERS: dict[str, Path] = {}


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="cothink-engine-tests-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


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


_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=8192,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

SPECS: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama", num_hidden_layers=2, seed=14),  # seed: greedy output is not repetitive
    # one layer: a block's stored K/V depends only on its own tokens, whatever view it was written under
    "llama_1l": dict(family="llama", num_hidden_layers=1),
    # Qwen3.5 hybrid: Gated DeltaNet + gated full attention, partial rotary
    "qwen35": dict(family="qwen3_5", layer_types=[LINEAR, FULL, LINEAR], head_dim=32, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4),
}


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases get noise; GDN decays become mild so state carries across blocks."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
        elif "norm" in name or name.endswith("bias"):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def tiny_folder(kind: str) -> Path:
    """A saved tiny checkpoint (with tokenizer) of SPECS[kind]; built once per process."""
    if kind not in _FOLDERS:
        import transformers as tf

        spec = dict(SPECS[kind])
        family = spec.pop("family")
        kw = {**_COMMON, **spec}
        if family == "llama":
            cfg_cls, model_cls = tf.LlamaConfig, tf.LlamaForCausalLM
        else:
            kw["num_hidden_layers"] = len(kw["layer_types"])
            cfg_cls, model_cls = tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM
        seed = spec.pop("seed", sorted(SPECS).index(kind) + 11)
        torch.manual_seed(seed)
        model = model_cls(cfg_cls(**kw)).eval()
        _perturb(model, seed)
        folder = _root() / kind
        model.save_pretrained(folder)
        make_tokenizer().save_pretrained(folder)
        _FOLDERS[kind] = folder
    return _FOLDERS[kind]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run engine tests on one torch thread (import this fixture into each engine test module).

    The tiny models' kernels are microseconds long; with several OpenMP threads on a busy 2-core machine
    the threads' spin-waits cost ~50x (measured: 186 ms vs 4 ms per tiny decode step)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_runner(kind: str, **limits: Any) -> ModelRunner:
    return cothink.load_model(tiny_folder(kind), **limits)


def fresh_runner(runner: ModelRunner, **limits: Any) -> ModelRunner:
    """A new runner (empty memory) sharing `runner`'s weights and tokenizer."""
    limits.setdefault("kv_tokens", 8192)
    return ModelRunner(runner.model, runner.tokenizer, **limits)


def make_engine(kind_or_runner: str | ModelRunner, *, kv_tokens: int = 16384, page_size: int = 16,
                **limits: Any) -> Engine:
    """An engine over a tiny model (by kind) or over a fresh runner sharing a loaded model's weights."""
    sched = {k: limits.pop(k) for k in list(limits) if k in SchedulerConfig.__dataclass_fields__}
    if isinstance(kind_or_runner, str):
        runner = load_runner(kind_or_runner, kv_tokens=kv_tokens, page_size=page_size,
                             **{k: limits.pop(k) for k in list(limits) if k in ("max_context",)})
    else:
        runner = fresh_runner(kind_or_runner, kv_tokens=kv_tokens, page_size=page_size,
                              **{k: limits.pop(k) for k in list(limits) if k in ("max_context",)})
    return Engine(runner, EngineLimits(scheduler=SchedulerConfig(**sched), **limits))


def smollm2_runner(**limits: Any) -> ModelRunner:
    """The embedded SmolLM2-135M-Instruct (converted into the cothink cache on first use)."""
    limits.setdefault("kv_tokens", 4096)
    return cothink.load_model("smollm2", **limits)


def ids(n: int, seed: int | random.Random, low: int = 0, high: int = VOCAB) -> list[int]:
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


async def until(predicate, timeout: float = 30.0) -> None:
    """Yield to the event loop (so engine steps run) until predicate() holds."""
    async def wait():
        while not predicate():
            await asyncio.sleep(0)

    await asyncio.wait_for(wait(), timeout)


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
def snapshot(engine: Engine, blocks: list[Block]) -> dict[str, Any]:
    mem = engine.memory()
    return {
        "blocks": [(b.name, len(b), list(b.tokens), b.version, list(b.pages), b.freed) for b in blocks],
        "free_pages": mem.free_pages,
        "live_blocks": mem.live_blocks,
        "used_pages": mem.used_pages,
    }
