"""The asyncio surface: blocks, extend, generate, probe, fork, release, on one step loop.

All memory changes happen on the event loop's thread: a step runs synchronously between awaits,
so user calls (fork, truncate, release) always land between steps, never inside one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch

from cothink.errors import (
    BlockBusyError,
    BlockFreedError,
    EmptyInputError,
    EngineClosedError,
    InputTooLongError,
    InvalidViewError,
    PoolExhaustedError,
    UnknownBlockError,
)
from cothink.execution.runner import ModelRunner, load_model
from cothink.execution.sampling import Sampler, SamplingParams
from cothink.memory.block import Block
from cothink.runtime.text import stop_token_ids as turn_end_ids
from cothink.runtime.work import (
    CoroutineStats,
    ExtendWork,
    GenerateWork,
    GenerationResult,
    Piece,
    ProbeWork,
    Work,
)
from cothink.scheduler.policy import Priority, PriorityClass, SchedulerConfig, plan_step

log = logging.getLogger("cothink.engine")


@dataclass(frozen=True)
class StepItemRecord:
    coroutine: str
    kind: str
    tokens: int
    view_tokens: int
    priority: str


@dataclass(frozen=True)
class StepRecord:
    """One forward pass: when it ran and which coroutines' items it carried."""

    index: int
    start: float  # perf_counter seconds
    end: float
    items: tuple[StepItemRecord, ...]

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.items)


@dataclass(frozen=True)
class WorkEvent:
    """A moment in a work's life, for metrics and traces.

    event: 'submit', 'scheduled' (first time in a step; value = queue wait s), 'first_token'
    (value = time to first token s), 'finish' (value = seconds since submit; detail = finish reason
    or error type).
    """

    event: str
    coroutine: str
    work: str  # 'extend', 'generate' or 'probe'
    priority: str
    block: str
    time: float
    value: float = 0.0
    detail: str = ""


@dataclass
class EngineLimits:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    on_pool_full: str = "wait"  # "wait": queue until memory frees (up to pool_wait_s); "error": raise at once
    pool_wait_s: float = 30.0
    max_input_tokens: int | None = None  # per extend/probe call
    timeline_steps: int = 100_000  # step records kept for traces
    max_tracked_coroutines: int = 10_000  # per-coroutine stats kept (oldest dropped first)


class Generation:
    """A running generation: iterate for Pieces, or `await collect()` for the whole result."""

    def __init__(self, work: GenerateWork):
        self._work = work
        self.result: GenerationResult | None = None

    @property
    def name(self) -> str:
        return self._work.name

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Piece]:
        try:
            while self.result is None:
                event = await self._work.queue.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, GenerationResult):
                    self.result = event
                    return
                if event.text or event.token_ids:
                    yield event
        finally:
            if self.result is None:  # the consumer was cancelled or stopped early
                self._work.engine._cancel(self._work)
                work = self._work
                self.result = GenerationResult(work.text, list(work.token_ids), "cancelled")

    async def collect(self) -> GenerationResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Stop before the next step (also what leaving `async with gen:` does if it is unfinished)."""
        self._work.engine._cancel(self._work)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.result is None:
            self.cancel()


class Engine:
    def __init__(self, runner: ModelRunner, limits: EngineLimits | None = None):
        self.runner = runner
        self.limits = limits or EngineLimits()
        self.tokenizer = runner.tokenizer
        self.stats: dict[str, CoroutineStats] = {}
        self.timeline: deque[StepRecord] = deque(maxlen=self.limits.timeline_steps)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.work_listeners: list[Callable[[WorkEvent], None]] = []
        self.steps = 0
        self._works: list[Work] = []
        self._writers: dict[int, Work] = {}
        self._holds: Counter[int] = Counter()  # engine-level references per block id
        self._handles: dict[int, Block] = {}
        self._seq = 0
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._waiting_since: dict[int, float] = {}

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        **limits: Any,
    ) -> Engine:
        """Load a model; limits: kv_tokens, page_size, max_context, dense_summary_min_tokens (memory),
        max_batch_tokens, max_batch_items, max_prefill_chunk, background_min_tokens (scheduler),
        on_pool_full, pool_wait_s, max_input_tokens (engine)."""
        memory_keys = {"kv_tokens", "page_size", "max_context", "dense_summary_min_tokens"}
        sched_keys = set(SchedulerConfig.__dataclass_fields__)
        runner = load_model(
            path_or_name, device, dtype, **{k: v for k, v in limits.items() if k in memory_keys}
        )
        sched = SchedulerConfig(**{k: v for k, v in limits.items() if k in sched_keys})
        rest = {k: v for k, v in limits.items() if k not in memory_keys | sched_keys}
        return cls(runner, EngineLimits(scheduler=sched, **rest))

    # ---- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.create_task(self._run(), name="cothink-step-loop")

    async def stop(self) -> None:
        """Finish: generations end with finish_reason 'cancelled', pending extends and probes raise
        EngineClosedError; nothing hangs."""
        for work in list(self._works):
            if not work.finished and not isinstance(work, GenerateWork):
                work.fail(EngineClosedError("the engine stopped"))
            self._cancel(work)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- blocks -------------------------------------------------------------------------------
    def block(self, name: str | None = None) -> Block:
        block = self.runner.new_block(name)
        block.owner = self
        self._holds[block.id] += 1
        self._handles[block.id] = block
        return block

    def fork(self, block: Block, name: str | None = None) -> Block:
        """A copy-on-write block sharing `block`'s content so far."""
        self._check(block)
        child = self.runner.fork(block, name)
        child.owner = self
        self._holds[child.id] += 1
        self._handles[child.id] = child
        return child

    def truncate(self, block: Block, n: int) -> None:
        """Rewind `block` to its first n tokens (also `block.truncate(n)`)."""
        self._check(block)
        self._check_not_written(block)
        self.runner.truncate(block, n)

    def release(self, block: Block) -> None:
        """Drop your handle; memory returns when no running work reads the block either."""
        self._check(block)
        if block.id in self._writers:
            self._cancel(self._writers[block.id])
        del self._handles[block.id]
        self._unhold(block)

    def _unhold(self, block: Block) -> None:
        self._holds[block.id] -= 1
        if self._holds[block.id] <= 0:
            del self._holds[block.id]
            self.runner.free(block)
            self._kick()

    def _check(self, block: Block) -> Block:
        if not isinstance(block, Block):
            raise UnknownBlockError(f"expected a Block, got {type(block).__name__}")
        if self._handles.get(block.id) is not block:
            if block.owner is self:
                raise BlockFreedError(f"block {block.name!r} was released")
            raise UnknownBlockError(f"block {block.name!r} does not belong to this engine")
        return block

    def _check_not_written(self, block: Block) -> None:
        writer = self._writers.get(block.id)
        if writer is not None and not writer.finished:
            raise BlockBusyError(f"block {block.name!r} is being written by coroutine {writer.name!r}")

    def _check_view(self, view: list[Block] | Block) -> list[Block]:
        view = [view] if isinstance(view, Block) else list(view)
        if not view:
            raise InvalidViewError("a view needs at least one block")
        for b in view:
            self._check(b)
        if len({b.id for b in view}) != len(view):
            raise InvalidViewError("a block appears twice in the view")
        return view

    # ---- coroutine operations -----------------------------------------------------------------
    async def extend(
        self,
        block: Block,
        text: str | None = None,
        token_ids: list[int] | None = None,
        view: list[Block] | None = None,
        *,
        priority: Priority | str | None = None,
        name: str | None = None,
    ) -> None:
        """Append input to `block`, read under `view` (default [block]); returns once it is in memory."""
        self._require_running()
        view = self._check_view(view if view is not None else [block])
        if view[-1] is not block:
            raise InvalidViewError(f"the view must end with the written block {block.name!r}")
        tokens = self._tokens(text, token_ids)
        self._check_not_written(block)
        self.runner.validate_input(view, tokens)
        work = ExtendWork(
            self, self._name(name), Priority.parse(priority, PriorityClass.BACKGROUND), view, tokens
        )
        self._submit(work)
        await self._wait(work)

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
    ) -> Generation:
        """Generate into view[-1]; iterate the result for Pieces or `await ...collect()`."""
        self._require_running()
        view = self._check_view(view)
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not any(b.length for b in view):
            raise EmptyInputError("the view is empty: there is nothing to continue")
        self._check_not_written(view[-1])
        self.runner.validate_input(view, [0])
        params = SamplingParams(temperature, top_k, top_p, seed, tuple(banned_token_ids or ()))
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        self.runner.check_token_ids(list(banned_token_ids or ()), "banned_token_ids")
        self.runner.check_token_ids(list(stop_token_ids or ()), "stop_token_ids")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        stop_ids = set(stop_token_ids or ())
        if stop_at_eos:
            stop_ids |= turn_end_ids(self.tokenizer, self.runner.config.eos_token_ids)
        work = GenerateWork(
            self,
            self._name(name),
            Priority.parse(priority, PriorityClass.BACKGROUND),
            view,
            Sampler(params),
            max_tokens,
            stops,
            frozenset(stop_ids),
        )
        self._submit(work)
        return Generation(work)

    async def probe(
        self,
        view: list[Block] | Block,
        question: str | list[int],
        choices: tuple[str, ...] | list[str] = ("yes", "no"),
        *,
        priority: Priority | str | None = None,
        name: str | None = None,
    ) -> dict[str, float]:
        """Probabilities of each choice right after `question` is read after `view` (one forward pass
        for single-token choices). Choices are tokenized exactly as given (mind a leading space)."""
        self._require_running()
        view = self._check_view(view)
        q = self._tokens(
            question if isinstance(question, str) else None,
            None if isinstance(question, str) else list(question),
        )
        if len(set(choices)) != len(choices) or not choices:
            raise ValueError("choices must be distinct and non-empty")
        encoded = {c: self._tokens(c, None) for c in choices}
        self.runner.validate_input(view, q + [0] * max(len(t) - 1 for t in encoded.values()))
        work = ProbeWork(
            self, self._name(name), Priority.parse(priority, PriorityClass.INTERACTIVE), view, q, encoded
        )
        self._submit(work)
        return await self._wait(work)

    async def _wait(self, work: ExtendWork | ProbeWork):
        """Await a work's result; if the caller is cancelled, the work stops before the next step."""
        try:
            return await work.future
        except asyncio.CancelledError:
            self._cancel(work)
            raise

    # ---- accounting ---------------------------------------------------------------------------
    def _stats(self, name: str) -> CoroutineStats:
        stats = self.stats.get(name)
        if stats is None:
            stats = self.stats[name] = CoroutineStats(name)
            # Keep the most recent coroutines only: default names (task names) are unique per task.
            while len(self.stats) > self.limits.max_tracked_coroutines:
                del self.stats[next(iter(self.stats))]
        return stats

    def memory(self):
        return self.runner.store.stats()

    # ---- internals ----------------------------------------------------------------------------
    def _notify(self, work: Work, event: str, value: float = 0.0, detail: str = "") -> None:
        if self.work_listeners:
            record = WorkEvent(
                event,
                work.name,
                work.kind,
                work.priority.klass.name.lower(),
                work.block.name,
                time.perf_counter(),
                value,
                detail,
            )
            for listener in self.work_listeners:
                listener(record)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _name(self, name: str | None) -> str:
        if name:
            return name
        task = asyncio.current_task()
        return task.get_name() if task is not None else "main"

    def _tokens(self, text: str | None, token_ids: list[int] | None) -> list[int]:
        if (text is None) == (token_ids is None):
            raise ValueError("give exactly one of text or token_ids")
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token_ids")
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = list(token_ids)
        if not tokens:
            raise EmptyInputError("the input is empty")
        self.runner.check_token_ids(tokens)
        limit = self.limits.max_input_tokens
        if limit is not None and len(tokens) > limit:
            raise InputTooLongError(f"{len(tokens)} input tokens exceed the limit of {limit}")
        return tokens

    def _require_running(self) -> None:
        if not self.running:
            raise EngineClosedError("the engine is not running: use `async with engine:`")

    def _submit(self, work: Work) -> None:
        for b in work.reads:
            self._holds[b.id] += 1
        if not isinstance(work, ProbeWork):
            self._writers[work.block.id] = work
        self._works.append(work)
        self._stats(work.name).works += 1
        log.debug("submit %s", work.kind, extra={"coroutine": work.name, "block": work.block.name})
        self._notify(work, "submit")
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _cancel(self, work: Work) -> None:
        if not work.finished:
            work.cancel()
            log.info("cancelled %s", work.kind, extra={"coroutine": work.name, "block": work.block.name})
        self._retire(work)

    def _retire(self, work: Work) -> None:
        if work in self._works:
            self._notify(work, "finish", time.perf_counter() - work.submitted, work.outcome)
            self._works.remove(work)
            if self._writers.get(work.block.id) is work:
                del self._writers[work.block.id]
            self._waiting_since.pop(id(work), None)
            for b in work.reads:
                self._unhold(b)

    def _fits(self, free: list[int]):
        store = self.runner.store

        def fits(work: Work, n: int) -> bool:
            need = store.pages_needed(work.block, work.block.length + n) + (
                len(work.choices) if isinstance(work, ProbeWork) and not work.pending else 0
            )
            if need <= free[0]:
                free[0] -= need
                self._waiting_since.pop(id(work), None)
                return True
            if self.limits.on_pool_full == "error" or need > store.pool.num_pages:
                self._fail(
                    work,
                    PoolExhaustedError(
                        f"KV pool cannot hold {n} more tokens for {work.name!r} "
                        f"({need} pages needed, {free[0]} free)"
                    ),
                )
            else:
                since = self._waiting_since.setdefault(id(work), time.perf_counter())
                if time.perf_counter() - since > self.limits.pool_wait_s:
                    self._fail(
                        work,
                        PoolExhaustedError(
                            f"KV pool stayed full for {self.limits.pool_wait_s:.0f}s; {work.name!r} gave up"
                        ),
                    )
            return False

        return fits

    def _fail(self, work: Work, exc: BaseException) -> None:
        log.warning("%s failed: %s", work.kind, exc, extra={"coroutine": work.name, "block": work.block.name})
        work.fail(exc)

    async def _run(self) -> None:
        while True:
            for work in [w for w in self._works if w.finished]:
                self._retire(work)
            if not self._works:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                ran = self._step()
            except Exception as exc:  # a bug in planning must not kill the loop: fail what is queued
                log.exception("engine step crashed; failing queued works")
                for work in list(self._works):
                    self._fail(work, exc)
                continue
            if ran:
                # Let coroutines and HTTP handlers stream, cancel and append input between steps;
                # a request takes a few loop passes, so yield more than once.
                for _ in range(3):
                    await asyncio.sleep(0)
                continue
            # Nothing could run (all waiting for memory): wait for a release instead of spinning.
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.05)
            except TimeoutError:
                pass

    def _step(self) -> bool:
        """Plan and run one step; False when nothing could be scheduled."""
        free = [self.runner.store.pool.free_pages]
        chosen = plan_step(
            [w for w in self._works if not w.finished], self.limits.scheduler, self._fits(free)
        )
        if not chosen:
            return False
        now = time.perf_counter()
        items, owners = [], []
        for work, n in chosen:
            try:
                work_items = work.items(n)
                for item in work_items:
                    self.runner.validate(item)
            except InputTooLongError as exc:
                if isinstance(work, GenerateWork):  # the context is full: a generation ends there
                    work._finish("length")
                else:
                    self._fail(work, exc)
                continue
            except Exception as exc:  # a bad work fails alone; the step goes on without it
                self._fail(work, exc)
                continue
            if work.first_scheduled is None:
                work.first_scheduled = now
                self._stats(work.name).queue_wait_s += now - work.submitted
                self._notify(work, "scheduled", now - work.submitted)
            items.extend(work_items)
            owners.append((work, len(work_items)))
        if not items:
            return True
        read = [sum(b.length for b in i.view[:-1]) + i.block.length for i in items]
        start = time.perf_counter()
        try:
            logits = self.runner.step(items)
        except Exception as exc:  # a failed step changes no memory; fail its works, keep serving
            log.exception("step failed")
            for work, _ in owners:
                self._fail(work, exc)
            return True
        end = time.perf_counter()
        records, row, counted = [], 0, set()
        for work, count in owners:
            mine, row_items = logits[row : row + count], items[row : row + count]
            tokens = sum(len(i.token_ids) for i in row_items)
            view_tokens = sum(read[row : row + count]) + tokens
            row += count
            stats = self._stats(work.name)
            if work.name not in counted:  # one forward pass per coroutine per step, however many works
                stats.forward_passes += 1
                counted.add(work.name)
            stats.tokens_written += tokens
            stats.tokens_read += view_tokens
            work.served += tokens
            records.append(
                StepItemRecord(work.name, work.kind, tokens, view_tokens, work.priority.klass.name.lower())
            )
            try:
                work.on_step(mine)
            except Exception as exc:
                self._fail(work, exc)
        self.steps += 1
        record = StepRecord(self.steps, start, end, tuple(records))
        self.timeline.append(record)
        for listener in self.step_listeners:
            listener(record)
        return True
