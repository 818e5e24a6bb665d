"""The asyncio surface: blocks, extend, generate, probe, fork, release, over one scheduler.

The engine checks every call once, here, then hands a work to the scheduler (cothink.scheduler),
which runs the step loop: forward passes run in a worker thread, so the event loop stays free,
and memory changes (fork, truncate, release) land between steps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cothink.errors import (
    BlockSealedError,
    EmptyInputError,
    EngineClosedError,
    InputTooLongError,
    InvalidParameterError,
    InvalidViewError,
)
from cothink.execution.runner import ModelRunner, load_model
from cothink.execution.sampling import SamplerState, SamplingParams, TokenConstraint
from cothink.memory.block import Block, span_at
from cothink.memory.snapshot import (
    LoadedSnapshot,
    capture_blocks,
    check_fits,
    check_identity,
    read_snapshot,
    restore_block,
    restore_plan,
    snapshot_bytes,
    snapshot_pages,
    write_snapshot,
)
from cothink.memory.store import MemoryStats, parse_bytes
from cothink.models.image_processing import (
    ImageLike,
    ImageProcessorConfig,
    placeholder_ids,
    preprocess_frames,
    preprocess_image,
    preprocess_video,
)
from cothink.models.text import stop_token_ids as turn_end_ids
from cothink.ops import native
from cothink.runtime import heap
from cothink.runtime.residency import Residency
from cothink.scheduler.accounting import Accounting, CoroutineStats, StepRecord, WorkEvent
from cothink.scheduler.budget import MemoryBudget
from cothink.scheduler.ownership import Ownership
from cothink.scheduler.policy import Priority, PriorityClass, SchedulerConfig, StepPolicy, plan_step
from cothink.scheduler.scheduler import Occupancy, Scheduler
from cothink.runtime.generation import Generation
from cothink.scheduler.work import (
    EncodeWork,
    ExtendWork,
    FutureWork,
    GenerateWork,
    GenerationResult,
    Piece,
    ProbeWork,
    StopRule,
    TowerSizes,
    VisionInput,
    VisionUnit,
)

__all__ = [
    "CoroutineStats",
    "Engine",
    "EngineLimits",
    "Generation",
    "GenerationResult",
    "Occupancy",
    "Piece",
    "StepRecord",
    "WorkEvent",
]

log = logging.getLogger("cothink.engine")

_RUNNER_KEYS = {
    "kv_tokens",
    "page_size",
    "max_context",
    "dense_summary_min_tokens",
    "attention_backend",
    "quantize",
    "fast",
}


@dataclass
class EngineLimits:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    on_pool_full: str = "wait"  # "wait": queue until memory frees (up to pool_wait_s); "error": raise at once
    pool_wait_s: float = 30.0
    max_input_tokens: int | None = None  # per extend/probe call
    timeline_steps: int = 100_000  # step records kept for traces
    max_tracked_coroutines: int = 10_000  # per-coroutine stats kept (oldest dropped first)
    threads: int | None = None  # torch threads for forward passes (default: the creating thread's)
    # bound on all block memory (KV pages + GDN records and summaries): bytes or "2GiB"; None: the pool
    memory_budget: int | str | None = None
    # with a memory_budget: under memory pressure, write idle unpinned blocks to disk (least recently read)
    spill: bool = True
    # seal the block of every generation that finishes with "stop" or "length" (docs/runtime.md, Memory)
    auto_seal: bool = False
    spill_dir: str | Path | None = None  # default: <cache dir>/spill/<pid>-<n>
    # refuse an image that would take more placeholder tokens (None: the checkpoint's pixel budget only)
    max_image_tokens: int | None = None
    # how each step's works are chosen: the engine's policy, or a replacement under test (StepPolicy)
    policy: StepPolicy = plan_step


class Engine:
    def __init__(self, runner: ModelRunner, limits: EngineLimits | None = None):
        self.runner = runner
        self.limits = limits or EngineLimits()
        self.tokenizer = runner.tokenizer
        self._accounting = Accounting(self.limits.timeline_steps, self.limits.max_tracked_coroutines)
        self._ownership = Ownership(runner)
        self._tokens_per_patch_block: float | None = None  # TowerSizes', counted once
        try:
            runner.store.budget_bytes = parse_bytes(self.limits.memory_budget)
        except ValueError as exc:
            raise InvalidParameterError(str(exc), param="memory_budget") from None
        budget = MemoryBudget(runner.store, self.limits.on_pool_full, self.limits.pool_wait_s)
        spill_dir = Path(self.limits.spill_dir) if self.limits.spill_dir is not None else None
        spill = self.limits.spill and runner.store.budget_bytes is not None
        self._residency = Residency(runner, self._ownership, spill_dir, spill)
        if spill:
            budget.reclaim = self._residency.reclaim
        threads = self.limits.threads or torch.get_num_threads()
        self._scheduler = Scheduler(
            runner,
            self.limits.scheduler,
            budget,
            self._accounting,
            self._ownership,
            threads,
            policy=self.limits.policy,
            auto_seal=self.limits.auto_seal,
        )
        self._loop_task: asyncio.Task | None = None

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        **limits: Any,
    ) -> Engine:
        """Load a model; limits: kv_tokens, page_size, max_context, dense_summary_min_tokens,
        attention_backend, quantize ("int8" / "int4": weight-only int8 / 4-bit linears) (runner),
        max_batch_tokens, max_batch_items, max_prefill_chunk, background_min_tokens,
        interactive_step_tokens, interactive_background_chunk, lone_prefill_chunk,
        vision_step_patch_blocks (vision tower patches x blocks one step may run) (scheduler),
        on_pool_full, pool_wait_s, max_input_tokens, threads, memory_budget, spill, spill_dir, auto_seal,
        policy (engine). With a memory_budget and no kv_tokens, the KV pool is sized so the whole budget
        could be KV pages."""
        sched_keys = set(SchedulerConfig.__dataclass_fields__)
        if limits.get("memory_budget") is not None and "kv_tokens" not in limits:
            limits["kv_tokens"] = _kv_tokens_for_budget(path_or_name, dtype, limits["memory_budget"])
        runner = load_model(
            path_or_name, device, dtype, **{k: v for k, v in limits.items() if k in _RUNNER_KEYS}
        )
        sched = SchedulerConfig(**{k: v for k, v in limits.items() if k in sched_keys})
        rest = {k: v for k, v in limits.items() if k not in _RUNNER_KEYS | sched_keys}
        return cls(runner, EngineLimits(scheduler=sched, **rest))

    # ---- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._loop_task is None:
            log.log(*native.start_note(self.runner.device))
            heap.engine_started()  # full collections would otherwise pause steps (runtime/heap.py)
            self._loop_task = asyncio.create_task(self._scheduler.run_forever(), name="cothink-step-loop")

    async def stop(self) -> None:
        """Finish: generations end with finish_reason 'cancelled', pending extends and probes raise
        EngineClosedError; the running step completes first; nothing hangs."""
        scheduler = self._scheduler
        for work in list(scheduler.works):
            if isinstance(work, (FutureWork, EncodeWork)):
                scheduler.fail(work, EngineClosedError("the engine stopped"))
            scheduler.cancel(work)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            finally:
                self._loop_task = None
                heap.engine_stopped()
        for work in list(scheduler.works):  # works that were in the last step
            scheduler.cancel(work)

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- introspection ------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, CoroutineStats]:
        return self._accounting.stats

    @property
    def timeline(self):
        return self._accounting.timeline

    @property
    def step_listeners(self):
        return self._accounting.step_listeners

    @property
    def work_listeners(self):
        return self._accounting.work_listeners

    @property
    def steps(self) -> int:
        return self._scheduler.steps

    @functools.cached_property
    def _turn_end_ids(self) -> frozenset[int]:
        """Tokens that end a chat turn (reading the vocabulary costs ~25 ms: once per engine)."""
        return frozenset(turn_end_ids(self.tokenizer, self.runner.config.eos_token_ids))

    @property
    def max_context(self) -> int:
        """The most positions a view plus new tokens may span."""
        return self.runner.max_context

    def memory(self) -> MemoryStats:
        """Block memory now: KV, GDN records, spilled bytes, the total and the budget."""
        return self.runner.store.stats()

    def occupancy(self) -> Occupancy:
        return self._scheduler.occupancy()

    # ---- blocks -------------------------------------------------------------------------------
    def block(self, name: str | None = None) -> Block:
        block = self.runner.new_block(name)
        block.owner = self
        return self._ownership.adopt(block)

    def fork(self, block: Block, name: str | None = None) -> Block:
        """A copy-on-write block sharing `block`'s content so far."""
        self._ownership.check(block)
        self._residency.ensure_resident([block])
        child = self.runner.fork(block, name)  # only committed content: safe while a step runs
        child.owner = self
        return self._ownership.adopt(child)

    def truncate(self, block: Block, n: int) -> None:
        """Rewind `block` to its first n tokens (also `block.truncate(n)`)."""
        self._ownership.check(block)
        self._scheduler.check_writable(block)
        self._residency.ensure_resident([block])
        with self._ownership.memory_lock:
            self.runner.truncate(block, n)

    def seal(self, block: Block) -> None:
        """Make `block` immutable (extend, generate into, truncate and fork then raise
        BlockSealedError). A sealed Gated DeltaNet block keeps only its head records, body summary
        and last-token window, so its linear memory stops growing with its length; it is read at
        its full length. Raises BlockBusyError while a work writes the block."""
        self._ownership.check(block)
        self._scheduler.check_writable(block)
        self._residency.ensure_resident([block])
        with self._ownership.memory_lock:  # a running forward may be reading its records
            self.runner.seal(block)

    def pin(self, block: Block) -> None:
        """Keep `block` resident: it is never spilled to disk (reloaded now if it was)."""
        self._ownership.check(block)
        self._residency.ensure_resident([block])
        block.pinned = True

    def unpin(self, block: Block) -> None:
        self._ownership.check(block)
        block.pinned = False

    async def save(self, path: str | Path, blocks: list[Block]) -> int:
        """Write `blocks` (tokens, KV, GDN records or sealed state, names, flags) to one snapshot
        file (safetensors + a JSON header with the model identity and dtype) and return its size.
        Memory the blocks share (forks' pages) is stored once. The blocks' committed content is
        copied between steps; hashing and writing run in a worker thread."""
        blocks = [self._ownership.check(b, param="blocks") for b in blocks]
        self._residency.ensure_resident(blocks)
        capture = capture_blocks(self.runner.store, blocks, self.runner.identity())
        return await asyncio.to_thread(write_snapshot, path, capture)

    def load(self, path: str | Path | LoadedSnapshot) -> list[Block]:
        """New blocks restored from a snapshot written by `save` (also by another process), in the
        order they were saved. Blocks that were forks share their common pages again (see
        `memory.snapshot.restore_plan`). `path` may be a snapshot already read
        (`memory.snapshot.read_snapshot`, e.g. in a worker thread). Raises SnapshotMismatchError if it
        was saved from a different model or dtype, SnapshotError if the file is not a snapshot or is
        damaged (checksums), PoolExhaustedError if the pool or the memory budget cannot hold it
        (nothing is loaded then)."""
        store = self.runner.store
        snapshot = path if isinstance(path, LoadedSnapshot) else read_snapshot(path)
        check_identity(snapshot.header, self.runner.identity(), snapshot.path)
        header = snapshot.header
        plan = restore_plan(snapshot, store.page_size)
        pages = snapshot_pages(header, store.page_size, plan) if store.attn_slot else 0
        check_fits(store, snapshot_bytes(store, snapshot, plan), pages)
        loaded: list[Block] = []
        try:
            for i, entry in enumerate(header.blocks):
                shared = plan[i]
                if shared.source >= 0:
                    block = self.fork(loaded[shared.source], name=entry.name)
                    if block.length > shared.tokens:
                        self.truncate(block, shared.tokens)
                else:
                    block = self.block(entry.name)
                loaded.append(block)
                restore_block(store, block, snapshot, i, kept=shared.tokens)
        except BaseException:
            for block in loaded:
                self.release(block)
            raise
        return loaded

    def release(self, block: Block) -> None:
        """Drop your handle; memory returns when no running work reads the block either."""
        self._ownership.check(block)
        writer = self._scheduler.writers.get(block.id)
        if writer is not None:
            self._scheduler.cancel(writer)
        self._ownership.drop_handle(block)
        self._scheduler.kick()

    # ---- coroutine operations -----------------------------------------------------------------
    async def extend(
        self,
        block: Block,
        text: str | None = None,
        token_ids: list[int] | None = None,
        view: list[Block] | None = None,
        *,
        image: ImageLike | None = None,
        video: Sequence[ImageLike] | np.ndarray | None = None,
        frames: Sequence[ImageLike] | np.ndarray | None = None,
        fps: float | None = None,
        timestamp: float | None = None,
        priority: Priority | str | None = None,
        name: str | None = None,
        deadline: float | datetime | None = None,
    ) -> None:
        """Append input to `block`, read under `view` (default [block]); returns once it is in memory.

        The input is one of: `text`, `token_ids`, `image` (a PIL image, an HxWx3 uint8 array or a
        local file path: vision-start, its placeholders, vision-end), `video` (frames sampled at `fps`,
        default the checkpoint's: per group of two frames its timestamp text, then as an image) or
        `frames` (one frame group of a live stream, at `timestamp` seconds, under a fixed per-frame
        pixel budget). Images are encoded by the vision tower as scheduled work first; a bad image
        raises InvalidParameterError and leaves the block as it was.
        `deadline` (seconds from now, or an aware datetime): past it, the work is dropped unrun
        (DeadlineExceededError)."""
        self._require_running()
        due = _deadline(deadline)
        visual = {k: v for k, v in (("image", image), ("video", video), ("frames", frames)) if v is not None}
        if visual:
            if len(visual) > 1 or text is not None or token_ids is not None:
                raise InvalidParameterError(
                    "give exactly one of text, token_ids, image, video or frames", param=next(iter(visual)))
            kind, value = next(iter(visual.items()))
            tokens, vision = await self._vision_input(kind, value, fps, timestamp)
            self._require_running()  # it may have stopped while the pixels were prepared: nothing would run
        else:
            tokens, vision = self._tokens(text, token_ids), None
        span = span_at(vision.runs(), len(tokens)) if vision is not None else len(tokens)
        view = self._view(view if view is not None else [block], span, writer=block)
        work = ExtendWork(
            self._name(name),
            Priority.parse(priority, PriorityClass.BACKGROUND),
            view,
            self._scheduler.next_seq(),
            tokens,
            vision,
        )
        if vision is None:
            self._scheduler.submit(work, deadline=due)
            await self._wait(work)
            return
        encode = EncodeWork(work.coroutine, work.priority, self._scheduler.next_seq(), work,
                            self._tower_sizes())
        self._scheduler.submit(encode, deadline=due)
        try:
            await work.future
        except asyncio.CancelledError:
            self._scheduler.cancel(encode)
            self._scheduler.cancel(work)
            raise

    async def _vision_input(
        self, kind: str, value: Any, fps: float | None, timestamp: float | None
    ) -> tuple[list[int], VisionInput]:
        """An image, clip or frame group -> the extend's tokens and its units (preprocessed off the
        event loop; every check raises InvalidParameterError naming `kind` before anything is written)."""
        vision = self.runner.vision
        if vision is None:
            raise InvalidParameterError(
                f"this model has no vision tower: it cannot read an {kind}", param=kind)
        cfg = vision.config
        if kind == "image":
            pixels = await asyncio.to_thread(preprocess_image, value, self.image_processor())
            groups: list[tuple[list[int], Any]] = [([], pixels)]
        else:
            if self.tokenizer is None:
                raise InvalidParameterError(f"{kind} needs a tokenizer for its timestamps", param=kind)
            if kind == "video":
                found = await asyncio.to_thread(preprocess_video, value, vision.video, fps=fps)
            else:
                if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
                    raise InvalidParameterError("frames need timestamp= (seconds, a number)", param="frames")
                found = [await asyncio.to_thread(preprocess_frames, value, float(timestamp), vision.video)]
            groups = [(self.tokenizer.encode(g.text, add_special_tokens=False), g) for g in found]
        tokens: list[int] = []
        units: list[VisionUnit] = []
        for prefix, px in groups:
            tokens.extend(prefix)
            first = len(tokens) + 1  # after vision-start
            units.append(VisionUnit(px.pixel_values, px.grid, first, px.merged_rows, px.merged_cols))
            tokens.extend(placeholder_ids(cfg, px.tokens, video=kind != "image"))
        limit = self.limits.max_input_tokens
        if limit is not None and len(tokens) > limit:
            raise InputTooLongError(f"the {kind} takes {len(tokens)} tokens, over the limit of {limit}",
                                    param=kind)
        return tokens, VisionInput(units)

    def image_processor(self) -> ImageProcessorConfig:
        """How images are preprocessed: the checkpoint's config, with the engine's max_image_tokens."""
        vision = self.runner.vision
        if vision is None:
            raise InvalidParameterError("this model has no vision tower", param="image")
        if self.limits.max_image_tokens is None:
            return vision.image
        return replace(vision.image, max_image_tokens=self.limits.max_image_tokens)

    def _feature_row_bytes(self) -> int:
        """Bytes of one placeholder's features: its merged row and one row per DeepStack layer."""
        vision = self.runner.vision
        assert vision is not None
        size = torch.empty((), dtype=vision.tower.dtype).element_size()
        return vision.config.out_hidden_size * size * (1 + len(vision.config.deepstack_layers))

    def _tower_sizes(self) -> TowerSizes:
        """What the scheduler admits and budgets for an encode: tower depth, feature and state rows,
        and a patch-block's cost in text tokens."""
        vision = self.runner.vision
        assert vision is not None
        if self._tokens_per_patch_block is None:
            text = max(1, self.runner.model.token_macs())
            self._tokens_per_patch_block = vision.tower.patch_block_macs() / text
        return TowerSizes(vision.tower.depth, self._feature_row_bytes(), vision.tower.state_row_bytes(),
                          self._tokens_per_patch_block)

    def generate(
        self,
        view: list[Block] | Block,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        stop_token_ids: list[int] | None = None,
        banned_token_ids: list[int] | None = None,
        priority: Priority | str | None = None,
        name: str | None = None,
        stop_at_eos: bool = True,
        logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
        deadline: float | datetime | None = None,
    ) -> Generation:
        """Generate into view[-1]; iterate the result for Pieces or `await ...collect()`.
        Past `deadline` the generation is dropped before its next step (DeadlineExceededError)."""
        self._require_running()
        due = _deadline(deadline)
        view = self._view(view, 1)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidParameterError("max_tokens must be an int >= 1", param="max_tokens")
        if not any(b.length for b in view):
            raise EmptyInputError("the view is empty: there is nothing to continue", param="view")
        params = SamplingParams(temperature, top_k, top_p, seed, tuple(banned_token_ids or ()), logprobs)
        self.runner.check_token_ids(list(banned_token_ids or ()), "banned_token_ids")
        self.runner.check_token_ids(list(stop_token_ids or ()), "stop_token_ids")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if stops and self.tokenizer is None:
            raise InvalidParameterError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)", param="stop"
            )
        stop_ids = set(stop_token_ids or ())
        if stop_at_eos:
            stop_ids |= self._turn_end_ids
        work = GenerateWork(
            self._name(name),
            Priority.parse(priority, PriorityClass.BACKGROUND),
            view,
            self._scheduler.next_seq(),
            SamplerState(params, constraint=constraint),
            StopRule(max_tokens, frozenset(stop_ids), stops),
            self.tokenizer,
        )
        self._scheduler.submit(work, deadline=due)
        return Generation(work, self._scheduler)

    async def probe(
        self,
        view: list[Block] | Block,
        question: str | list[int],
        choices: tuple[str, ...] | list[str] = ("yes", "no"),
        *,
        priority: Priority | str | None = None,
        name: str | None = None,
        deadline: float | datetime | None = None,
    ) -> dict[str, float]:
        """Probabilities of each choice right after `question` is read after `view` (one forward pass
        for single-token choices). Choices are tokenized exactly as given (mind a leading space)."""
        self._require_running()
        due = _deadline(deadline)
        q = self._tokens(
            question if isinstance(question, str) else None,
            None if isinstance(question, str) else list(question),
            param="question",
        )
        if not choices or len(set(choices)) != len(choices):
            raise InvalidParameterError("choices must be distinct and non-empty", param="choices")
        encoded = {c: self._tokens(c, None, param="choices") for c in choices}
        view = self._view(view, len(q) + max(len(t) for t in encoded.values()) - 1, writer=None)
        work = ProbeWork(
            self._name(name),
            Priority.parse(priority, PriorityClass.INTERACTIVE),
            view,
            self._scheduler.next_seq(),
            q,
            encoded,
        )
        self._scheduler.submit(work, deadline=due)
        return await self._wait(work)

    # ---- the boundary: every check happens here, once ------------------------------------------
    def _view(
        self, view: list[Block] | Block, new_tokens: int, writer: Block | None | bool = True
    ) -> list[Block]:
        """A call's view, checked: the caller's live handles; unless `writer` is None (the view is
        only read), ending with the written block (`True`: view[-1]), unsealed and written by no
        other work; then, every block in memory, the runner's view rule (ModelRunner.check_view:
        a block at least, distinct, and the view plus `new_tokens` within the context)."""
        view = [view] if isinstance(view, Block) else list(view)
        for b in view:
            self._ownership.check(b, param="view")
        if writer is not None and view:
            block = view[-1] if writer is True else writer
            if view[-1] is not block:
                raise InvalidViewError(
                    f"the view must end with the written block {block.name!r}", param="view"
                )
            if block.sealed:
                raise BlockSealedError(f"block {block.name!r} is sealed: it cannot be written", param="view")
            self._scheduler.check_writable(block)
        self._residency.ensure_resident(view)
        self.runner.check_view(view, new_tokens)
        return view

    def _tokens(self, text: str | None, token_ids: list[int] | None, param: str = "token_ids") -> list[int]:
        if (text is None) == (token_ids is None):
            raise InvalidParameterError("give exactly one of text or token_ids", param=param)
        if text is not None:
            if self.tokenizer is None:
                raise InvalidParameterError("this model has no tokenizer; pass token_ids", param=param)
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = list(token_ids)
        if not tokens:
            raise EmptyInputError("the input is empty", param=param)
        self.runner.check_token_ids(tokens, param)
        limit = self.limits.max_input_tokens
        if limit is not None and len(tokens) > limit:
            raise InputTooLongError(f"{len(tokens)} input tokens exceed the limit of {limit}", param=param)
        return tokens

    def _name(self, name: str | None) -> str:
        if name:
            return name
        task = asyncio.current_task()
        return task.get_name() if task is not None else "main"

    def _require_running(self) -> None:
        if not self.running:
            raise EngineClosedError("the engine is not running: use `async with engine:`")

    async def _wait(self, work: FutureWork):
        """Await a work's result; if the caller is cancelled, the work stops before the next step."""
        try:
            return await work.future
        except asyncio.CancelledError:
            self._scheduler.cancel(work)
            raise


def _kv_tokens_for_budget(path_or_name: str | Path, dtype: torch.dtype, budget: int | str) -> int:
    """KV pool size (tokens) for a memory budget: as many tokens as the budget holds as KV alone."""
    from cothink.models.config import load_config
    from cothink.models.hub import resolve_model_path

    try:
        total = parse_bytes(budget)
    except ValueError as exc:
        raise InvalidParameterError(str(exc), param="memory_budget") from None
    cfg = load_config(resolve_model_path(path_or_name))
    per_token = cfg.kv_bytes_per_token(dtype.itemsize)
    return max(1, total // per_token) if per_token else 1


def _deadline(deadline: float | datetime | None) -> float | None:
    """A deadline on the scheduler's clock (time.perf_counter): seconds from now, or an aware
    datetime (absolute)."""
    if deadline is None:
        return None
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None:
            raise InvalidParameterError("a datetime deadline must be timezone-aware", param="deadline")
        seconds = (deadline - datetime.now(timezone.utc)).total_seconds()
    elif isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
        seconds = float(deadline)
    else:
        raise InvalidParameterError(
            "deadline must be seconds from now or an aware datetime", param="deadline"
        )
    return time.perf_counter() + seconds
