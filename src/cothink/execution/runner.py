"""ModelRunner: the synchronous, exact core. Blocks in, logits out.

`load_model` returns one. The engine (cothink.runtime) drives `step` with many items per forward;
`extend` is the single-item convenience of the public API.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cothink.errors import (
    BlockSealedError,
    EmptyInputError,
    InputTooLongError,
    InvalidTokenIdError,
    InvalidViewError,
)
from cothink.execution.attention_backends import ExecutionBackend, select_backend
from cothink.execution.cache import ExecutionCache
from cothink.execution.fused_decode import FusedDecode
from cothink.execution.linear_state import seal_records
from cothink.execution.step import StepItem, ViewBatch, undo
from cothink.execution.threads import run_compute
from cothink.memory.block import Block
from cothink.memory.snapshot import ModelIdentity
from cothink.memory.store import BlockStore
from cothink.models.config import ModelConfig, VisionConfig, load_config
from cothink.models.image_processing import (
    ImageProcessorConfig,
    VideoProcessorConfig,
    load_processor_configs,
)
from cothink.models.transformer import CausalLM
from cothink.models.vision import EncodeState, PatchGrid, VisionFeatures, VisionTower
from cothink.models.weights import load_vision_tower, load_weights
from cothink.ops.rope import Rotary

_LOGITS_MODES = ("all", "last", "none")


@dataclass
class ForwardResult:
    """A step's forward pass before it is published (see `ModelRunner.forward`)."""

    batch: ViewBatch
    logits: list[torch.Tensor]  # per item

    @property
    def path(self) -> str:
        """Which code ran the step ("fused", "native", "torch", "reference")."""
        return self.batch.path


@dataclass
class Vision:
    """A multimodal model's vision side: the tower and the checkpoint's pixel preprocessing."""

    config: VisionConfig
    tower: VisionTower
    image: ImageProcessorConfig
    video: VideoProcessorConfig

    def encode(self, pixels: torch.Tensor, grid: PatchGrid) -> VisionFeatures:
        """One image or frame group's patches -> its features (context-free: each is encoded alone)."""
        with torch.inference_mode():
            return self.tower(pixels.to(self.tower.patch_embed.proj.weight.device), [grid])

    # `encode` in resumable stages (the scheduler spreads an image over steps): start, run until
    # `state.done == tower.depth`, finish; features equal to `encode`'s up to rounding (VisionTower.run)
    def start(self, pixels: torch.Tensor, grid: PatchGrid) -> EncodeState:
        with torch.inference_mode():
            return self.tower.start(pixels.to(self.tower.patch_embed.proj.weight.device), [grid])

    def run(self, state: EncodeState, patch_blocks: float) -> float:
        with torch.inference_mode():
            return self.tower.run(state, patch_blocks)

    def finish(self, state: EncodeState) -> VisionFeatures:
        with torch.inference_mode():
            return self.tower.finish(state)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any,
        *,
        kv_tokens: int = 32768,
        page_size: int = 16,
        max_context: int | None = None,
        dense_summary_min_tokens: int | None = None,
        attention_backend: str | ExecutionBackend = "auto",
        vision: Vision | None = None,
    ):
        cfg = model.config
        self.model, self.config, self.tokenizer = model, cfg, tokenizer
        self.vision = vision  # None: a text-only model (images are refused)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.rotary = Rotary(cfg.hf_text_config, cfg.rotary_head_dim, self.device)
        self.store = BlockStore(cfg, kv_tokens, page_size, self.dtype, self.device)
        self.max_context = (
            max_context or getattr(cfg.hf_text_config, "max_position_embeddings", None) or 1 << 20
        )
        # A dense [B|A] summary pays off once replaying the body costs more than applying a K x K map.
        if dense_summary_min_tokens is None:
            dense_summary_min_tokens = 4 * cfg.linear_config.k_dim if cfg.linear_config else 0
        self.dense_summary_min_tokens = dense_summary_min_tokens
        # chosen once (execution/attention_backends.py): it makes the model its own (the native
        # backend swaps in its modules) and decides, per step, which path runs the step. Attached
        # on the compute thread: the modules it builds may copy weights, and a parallel torch op on
        # this thread would give it an OpenMP pool of its own (execution/threads.py compute_executor)
        self.backend = select_backend(attention_backend, self.device)
        run_compute(self.backend.attach, model)
        # writer states and last logits of this runner's blocks (entries dropped on truncate and free)
        self.cache = ExecutionCache()
        self._identity: ModelIdentity | None = None

    @property
    def fused_decode(self) -> FusedDecode | None:
        """The backend's fused decode step: small decode steps' decoder layers (and the final norm and
        lm_head) in one C call (execution/fused_decode.py; results identical to the per-module path).
        None where it never applies; set it to None to switch it off for this runner. It reads the
        model's modules when the runner is built: after replacing one, set a new
        `FusedDecode.for_model(runner.model)`."""
        return self.backend.fused

    @fused_decode.setter
    def fused_decode(self, fused: FusedDecode | None) -> None:
        self.backend.fused = fused

    # ---- blocks -------------------------------------------------------------------------------
    def new_block(self, name: str | None = None) -> Block:
        block = self.store.new_block(name)
        block.owner = self
        return block

    def free(self, block: Block) -> None:
        self.store.free(block)
        self.cache.drop(block)

    def fork(self, block: Block, name: str | None = None) -> Block:
        child = self.store.fork(block, name)
        child.owner = self
        return child

    def truncate(self, block: Block, n: int) -> None:
        self.store.truncate(block, n)
        self.cache.drop(block)

    def seal(self, block: Block) -> None:
        """Make `block` immutable; its Gated DeltaNet records shrink to what reading it needs (head
        records, body summary, last-W window: execution/linear_state.py `seal_records`), so its
        linear memory no longer grows with its length. Call between steps (the engine holds the
        memory lock)."""
        self.store.check(block)
        if block.sealed:
            return
        if block.linear:
            mixers = [self.model.model.layers[layer].mixer for layer in self.config.linear_layers]
            with torch.inference_mode():
                sealed = [seal_records(m, rec, block.length) for m, rec in zip(mixers, block.linear)]
            for old, new in zip(block.linear, sealed):
                if new is not old:
                    old.release()  # copy-on-write sharers keep the rows they read
            block.linear = sealed
        block.sealed = True

    def identity(self) -> ModelIdentity:
        """What a snapshot of this runner's blocks records about the model (and checks on load):
        fingerprints of the text config and of the weights (each parameter's name, shape and first
        elements), and the memory dtype."""
        if self._identity is None:
            text = self.config.hf_text_config
            raw = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
            # where and with which library version it was loaded from is not the model's identity
            skip = ("transformers_version", "torch_dtype", "dtype")
            config = json.dumps(
                {k: v for k, v in raw.items() if not k.startswith("_") and k not in skip},
                sort_keys=True, default=str,
            )
            weights = hashlib.sha256()
            for name, param in sorted(self.model.state_dict().items()):
                weights.update(f"{name}{tuple(param.shape)}".encode())
                weights.update(param.detach().flatten()[:256].float().cpu().numpy().tobytes())
            self._identity = ModelIdentity(
                self.config.family,
                hashlib.sha256(config.encode()).hexdigest(),
                weights.hexdigest(),
                str(self.dtype).removeprefix("torch."),
            )
        return self._identity

    # ---- forward ------------------------------------------------------------------------------
    def extend(
        self, block: Block, token_ids: list[int], view: list[Block] | None = None, *, logits: str = "all"
    ) -> torch.Tensor:
        """Append tokens to `block`, attending causally to `view` (which must end with `block`).

        Returns float32 logits [len(token_ids), vocab] ('all'), [1, vocab] ('last') or [0, vocab] ('none').
        """
        return self.step([StepItem(block, list(token_ids), view, logits)])[0]

    # ---- the rules every caller's input is checked against (once, at the boundary) -------------
    def check_token_ids(self, ids: list[int], param: str = "token_ids") -> None:
        """The token-id rule: plain ints in [0, vocab)."""
        vocab = self.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise InvalidTokenIdError(f"{param} must be ints in [0, {vocab})", param=param)

    def check_view(self, view: list[Block], new_tokens: int, read_lengths: list[int] | None = None) -> None:
        """The view rule: blocks live and distinct, and the view (read up to `read_lengths` before
        its last block) plus `new_tokens` within the model's context."""
        if not view:
            raise InvalidViewError("a view needs at least one block", param="view")
        for b in view:
            self.store.check(b)
            if b.spilled is not None:
                raise InvalidViewError(f"block {b.name!r} is spilled to disk: reload it first", param="view")
        if len({b.id for b in view}) != len(view):
            raise InvalidViewError("a block appears twice in the view", param="view")
        if read_lengths is not None:
            if len(read_lengths) != len(view) - 1 or any(
                not 0 <= n <= b.length for n, b in zip(read_lengths, view)
            ):
                raise InvalidViewError(
                    "read_lengths must give, for each block before the writer, 0..len(block)",
                    param="read_lengths",
                )
            for b, n in zip(view, read_lengths):
                if b.sealed and n not in (b.length, b.length - 1) and n:
                    raise InvalidViewError(
                        f"sealed block {b.name!r} can be read only at its length or one token less",
                        param="read_lengths",
                    )
        self.check_context(view, new_tokens, read_lengths)

    def check_context(
        self, view: list[Block], new_tokens: int, read_lengths: list[int] | None = None
    ) -> None:
        """The context part of the view rule: the view (read up to `read_lengths` before its last
        block) plus `new_tokens` fits the model's context. The engine checks this at every step, as
        views grow; the rest of the rule holds from submission on."""
        spans = [b.position_span for b in view]
        if read_lengths is not None:
            spans[:-1] = [b.span_at(n) for b, n in zip(view, read_lengths)]
        total = sum(spans) + new_tokens
        if total > self.max_context:
            raise InputTooLongError(
                f"view would span {total} positions; the model allows {self.max_context}", param="view"
            )

    def validate(self, item: StepItem) -> None:
        """Raise a typed error, changing nothing, unless the item can run."""
        if item.logits not in _LOGITS_MODES:
            raise ValueError(f"logits must be one of {_LOGITS_MODES}, got {item.logits!r}")
        self.store.check(item.block)
        if item.block.sealed:
            raise BlockSealedError(f"block {item.block.name!r} is sealed: it cannot be written", param="view")
        if not item.view or item.view[-1] is not item.block:
            raise InvalidViewError(f"the view must end with the written block {item.block.name!r}")
        self.check_view(item.view, item.positions_added, item.read_lengths)
        if item.vision is not None and self.rotary.mrope_axes is None:
            raise InvalidViewError("image placeholders need a multimodal model", param="vision")
        if not item.token_ids:
            raise EmptyInputError(f"no tokens to append to block {item.block.name!r}")
        self.check_token_ids(item.token_ids)

    def cached_logits(self, prefix: list[Block]) -> torch.Tensor | None:
        """Logits after the last token of `prefix` (a view ending with a non-empty block), if the
        last write of that block computed them under this same view; else None (also while an
        image in it is being written: readers see it only once whole)."""
        if any(b.readable_length != b.length for b in prefix):
            return None
        return self.cache.last_logits(prefix)

    def step(self, items: list[StepItem], *, validate: bool = True) -> list[torch.Tensor]:
        """One forward pass over all items, committed; returns each item's logits (see `extend`).

        `validate=False` is for callers (the engine's scheduler) that already checked every item
        against the same rules at their own boundary; the runner then only asserts.
        """
        batch = self.prepare(items, validate=validate)
        try:
            result = run_compute(self.forward, batch)  # where the weights' OpenMP pool lives
        except BaseException:
            self.abort(items)  # a failed step changes nothing
            raise
        return self.commit(result)

    # A step in three phases, so the engine can run the middle one off its event loop:
    # prepare (reserve pages, plan the batch) -> forward (compute only) -> commit (publish).
    def prepare(self, items: list[StepItem], *, validate: bool = True) -> ViewBatch:
        """Reserve memory for the items and plan the batch; nothing is visible until `commit`."""
        if validate:
            for item in items:
                self.validate(item)
        else:
            assert all(item.view and item.view[-1] is item.block and item.token_ids for item in items)
        if len({item.block.id for item in items}) != len(items):
            raise InvalidViewError("two items in one step write the same block")
        self.store.reserve([(item.block, item.block.length + len(item.token_ids)) for item in items])
        try:
            return ViewBatch(
                self.store, self.rotary, items, self.dense_summary_min_tokens, self.backend, self.cache
            )
        except BaseException:
            self.abort(items)
            raise

    def forward(self, batch: ViewBatch) -> ForwardResult:
        """The forward pass of a prepared step. It writes keys into the reserved pages and changes
        nothing else that anyone can see (GDN records and lengths are published by `commit`)."""
        ids = [t for item in batch.items for t in item.token_ids]
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids, device=self.device), batch, batch.logit_rows().to(self.device),
                batch.metadata.layers, batch.vision, batch.metadata.to_logits,
            )
        out, row = [], 0
        for item in batch.items:
            n = {"all": len(item.token_ids), "last": 1, "none": 0}[item.logits]
            out.append(logits[row : row + n])
            row += n
        return ForwardResult(batch, out)

    def abort(self, items: list[StepItem]) -> None:
        """Undo a prepared step that will not be committed (pages reserved beyond each block)."""
        for item in items:
            undo(self.store, item)

    def commit(self, result: ForwardResult, keep: list[bool] | None = None) -> list[torch.Tensor]:
        """Publish a forward pass (items with keep[i] False are dropped instead); returns the logits."""
        batch = result.batch
        batch.commit(keep)
        batch.remember_logits(result.logits, keep)
        return result.logits


def _has_vision_weights(folder: Path) -> bool:
    """Whether the checkpoint holds a vision tower (a multimodal config may ship without one)."""
    from safetensors import safe_open

    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            if any(k.startswith(("model.visual.", "visual.")) for k in f.keys()):
                return True
    return False


def load_model(
    path_or_name: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    quantize: str | None = None,
    fast: bool = True,
    **limits: Any,
) -> ModelRunner:
    """Load a local Hugging Face folder (or the embedded name 'smollm2') as a ModelRunner.

    `quantize="int8"` / `"int4"`: weight-only int8 / 4-bit linears (Llama, Qwen2 and Qwen3 families;
    models/quantize.py, models/quant4.py).
    `fast=False` keeps the plain per-projection modules (the eager path the fast one is tested
    against). `limits` go to ModelRunner: kv_tokens (pool size), page_size, max_context,
    dense_summary_min_tokens, attention_backend ("auto", "torch", "native" or "reference").
    """
    from transformers import AutoTokenizer

    from cothink.models.hub import resolve_model_path

    folder = resolve_model_path(path_or_name)
    cfg: ModelConfig = load_config(folder)
    # on the compute thread, where the forward passes run: no second OpenMP pool (execution/threads.py)
    model = run_compute(load_weights, cfg, folder, dtype, device, fuse=fast, quantize=quantize)
    vision = None
    if cfg.vision is not None and _has_vision_weights(folder):
        tower = run_compute(load_vision_tower, cfg.vision, folder, dtype, device)
        vision = Vision(cfg.vision, tower, *load_processor_configs(folder, cfg.vision))
    has_tokenizer = any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True) if has_tokenizer else None
    return ModelRunner(model, tokenizer, vision=vision, **limits)
