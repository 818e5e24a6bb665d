"""The scheduler: owns the submitted works, the block writers and holds, memory admission and the
step loop. One step is schedule -> run -> postprocess:

- schedule (event-loop thread): choose (work, tokens) pairs (`plan_step`), fail what admission
  refused, sample every chosen generation's next token in one batched stage, build step items;
- run (a worker thread): one forward pass over all items (`ModelRunner.step`), holding the memory
  lock, so the event loop keeps serving agents and HTTP handlers during long steps (a short step of
  the fused C decode path runs on the event loop itself: `INLINE_STEP_S`); then the
  step's other compute (at most one encode, `EncodeWork`, running a bounded part of one image or
  frame group through the vision tower: `vision_step_patch_blocks` of patches x blocks, less while
  an interactive generation decodes, `encode_step_patch_blocks`; so an image or a long clip is
  encoded over many steps, between which everyone else's tokens are served);
- postprocess (event-loop thread): hand each work its logits, emit pieces and results, account.

A running step only computes: pages are reserved before it and records, lengths and caches are
published after it, on the event loop. A user's truncate (the one change that could pull memory
from under a running step) takes the memory lock the step holds, so it lands between steps.
A cancelled work gives up its block at once (a new writer may be submitted immediately); if it
is part of the running step, that step's items for it are not committed and its holds are
released after the step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cothink.errors import BlockBusyError, CothinkError, DeadlineExceededError, InputTooLongError
from cothink.execution.runner import ForwardResult, ModelRunner
from cothink.execution.sampling import sample
from cothink.execution.step import StepItem, ViewBatch
from cothink.execution.threads import (
    ThreadChooser,
    compute_executor,
    loop_step_threads,
    threads_for,
    use_threads,
)
from cothink.memory.block import Block
from cothink.scheduler.accounting import Accounting, StepItemRecord, StepRecord
from cothink.scheduler.budget import MemoryBudget
from cothink.scheduler.ownership import Ownership
from cothink.scheduler.policy import (
    FairShares,
    SchedulerConfig,
    StepPolicy,
    interactive_decoding,
    plan_step,
)
from cothink.scheduler.work import GenerateWork, Work

log = logging.getLogger("cothink.engine")
T = TypeVar("T")

# A step whose forward pass runs wholly in the C kernels' fused decode path ("fused": torch does only
# the embedding and glue, the kernels work on their own helper threads) and whose width took at most
# this long lately runs on the event-loop thread itself. Handing it to the compute thread and back
# wakes a sleeping thread twice: ~0.3 ms a token on a 2-vCPU VM (bench/step_phases.py, "unaccounted":
# int4 SmolLM2 0.43 -> 0.16 ms of 5.9), which the loop cannot use anyway (the forward takes both
# cores). Longer steps stay off the loop, so agents and HTTP handlers keep running during them.
INLINE_STEP_S = 0.025


@dataclass
class Planned:
    """One work's part of a step."""

    work: Work
    tokens: int
    items: list[StepItem]
    view_tokens: int = 0  # positions read before the step (for accounting)


@dataclass
class StepPlan:
    planned: list[Planned] = field(default_factory=list)

    @property
    def items(self) -> list[StepItem]:
        return [item for p in self.planned for item in p.items]

    @property
    def works(self) -> set[Work]:
        return {p.work for p in self.planned}


@dataclass(frozen=True)
class Occupancy:
    """What the scheduler holds right now (public introspection for eval, server and tests)."""

    works: int  # registered, not yet retired
    runnable: int
    paused: int
    writers: int  # blocks with a registered writer
    held_blocks: int  # blocks referenced by a handle or a work
    in_flight: int  # works in the step running now


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig,
        budget: MemoryBudget,
        accounting: Accounting,
        ownership: Ownership,
        threads: int,
        policy: StepPolicy = plan_step,
        auto_seal: bool = False,
    ):
        self.runner, self.config, self.budget = runner, config, budget
        self.policy = policy
        self.accounting, self.ownership = accounting, ownership
        self.threads = ThreadChooser(threads)
        self.works: list[Work] = []
        self.writers: dict[int, Work] = {}
        self.shares = FairShares()
        self.steps = 0
        self._seq = 0
        self._in_flight: set[Work] = set()
        self.auto_seal = auto_seal  # seal a generation's block when it finishes (EngineLimits.auto_seal)
        self._wake: asyncio.Event | None = None
        self._executor = compute_executor()  # one process-wide compute thread (execution/threads.py)
        self.inline_step_s = INLINE_STEP_S  # 0: every forward pass on the compute thread

    # ---- submission and cancellation ------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def check_writable(self, block: Block) -> None:
        writer = self.writers.get(block.id)
        if writer is not None and not writer.finished:
            raise BlockBusyError(
                f"block {block.name!r} is being written by coroutine {writer.coroutine!r}", param="block"
            )

    def submit(self, work: Work, deadline: float | None = None) -> None:
        """Register a work; past `deadline` (a time.perf_counter() value) it is dropped unrun."""
        work.deadline = deadline
        for b in work.reads:
            self.ownership.hold(b)
            b.last_read = work.seq  # least recently read blocks are spilled first
        if work.writes_caller_block:
            self.writers[work.block.id] = work
        self.works.append(work)
        self.accounting.of(work.coroutine).works += 1
        log.debug("submit %s", work.kind, extra={"coroutine": work.coroutine, "block": work.target_name})
        self._event(work, "submit", work.wanted_tokens(), view=tuple(b.name for b in work.view))
        self.kick()

    def cancel(self, work: Work) -> None:
        """Stop `work` before its next step; its block is free for a new writer at once."""
        if not work.finished:
            work.cancel()
            log.info(
                "cancelled %s", work.kind, extra={"coroutine": work.coroutine, "block": work.target_name}
            )
        self._release_writer(work)
        if work not in self._in_flight:
            self._retire(work)
        self.kick()

    def set_paused(self, work: GenerateWork, paused: bool) -> None:
        """Pause or resume a generation (it keeps its pending token, sampler and output)."""
        if work.finished or work.paused == paused:
            return
        work.paused = paused
        self._event(work, "paused" if paused else "resumed")
        if not paused:
            self.kick()

    def fail(self, work: Work, exc: BaseException) -> None:
        if not work.finished:
            log.warning(
                "%s failed: %s",
                work.kind,
                exc,
                extra={"coroutine": work.coroutine, "block": work.target_name},
            )
            work.fail(exc)
        self._release_writer(work)
        if work not in self._in_flight:
            self._retire(work)

    def occupancy(self) -> Occupancy:
        return Occupancy(
            works=len(self.works),
            runnable=sum(w.runnable for w in self.works),
            paused=sum(isinstance(w, GenerateWork) and w.paused and not w.finished for w in self.works),
            writers=len(self.writers),
            held_blocks=len(self.ownership.holds),
            in_flight=len(self._in_flight),
        )

    def kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _release_writer(self, work: Work) -> None:
        if work.writes_caller_block and self.writers.get(work.block.id) is work:
            del self.writers[work.block.id]

    def _retire(self, work: Work) -> None:
        if work not in self.works:
            return
        self.works.remove(work)
        self._release_writer(work)
        self.budget.forget(work)
        work.release_memory(self.runner.store)
        for block in work.scratch_blocks():
            self.runner.free(block)
        for b in work.reads:
            self.ownership.unhold(b)
        answer = tuple(work.answer.items()) if work.answer is not None else ()
        self._event(work, "finish", time.perf_counter() - work.submitted, work.outcome, answer=answer)

    def _event(self, work: Work, event: str, value: float = 0.0, detail: str = "", **extra: Any) -> None:
        priority = work.priority.klass.name.lower()
        self.accounting.event(
            event, work.coroutine, work.kind, priority, work.target_name, value, detail, **extra
        )

    # ---- the loop ---------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        while True:
            for work in [w for w in self.works if w.finished]:
                self._retire(work)
            if not any(w.runnable for w in self.works):
                await self._sleep(None)
                continue
            try:
                with threads_for(1):  # the loop thread's torch work is small (execution/threads.py)
                    plan = self.schedule()
            except Exception as exc:  # a bug in planning must not kill the loop: fail what is queued
                log.exception("engine step planning crashed; failing queued works")
                for work in list(self.works):
                    self.fail(work, exc)
                continue
            if not plan.planned:  # nothing could run (waiting for memory): wait for a release
                await self._sleep(0.05)
                continue
            await self._run(loop, plan)
            # Let coroutines and HTTP handlers stream, cancel and append input between steps. Twice:
            # a coroutine woken by this step's results may start new tasks (asyncio.gather of probes);
            # they run one loop turn later, and should still make the next step.
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    async def _sleep(self, timeout: float | None) -> None:
        assert self._wake is not None
        self._wake.clear()
        # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns the wake when a cancel comes
        # in the same loop turn (Engine.stop wakes the loop, then cancels it), and the loop sleeps on.
        try:
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _run(self, loop: asyncio.AbstractEventLoop, plan: StepPlan) -> None:
        items = plan.items
        self._in_flight = plan.works
        start, path, threads = time.perf_counter(), "", 0
        try:
            if items:
                with threads_for(1):
                    batch = self.runner.prepare(items, validate=False)
                # Taken here, released by `_forward` when the forward ends (on the compute thread, or
                # here for a short step): a truncate cannot slip in between planning and running it.
                self.ownership.memory_lock.acquire()
                try:  # (the engine stopping: the running step finishes first, then it is undone)
                    if self._inline(batch):
                        result, threads = self._forward(batch, inline=True)
                    else:
                        result, threads = await _off_loop(loop, self._executor, self._forward, batch)
                except BaseException:
                    self.runner.abort(items)
                    raise
                # Publish on the event loop (block lengths change between steps, never inside one);
                # items of works cancelled meanwhile are dropped, as if they had not run.
                keep = [not p.work.finished for p in plan.planned for _ in p.items]
                with threads_for(1):
                    logits = self.runner.commit(result, keep)
                path = result.path
            else:
                logits = []
            computing = [p.work for p in plan.planned if p.work.computes]
            if computing:  # not a forward pass: no memory lock (it reads and writes no block)
                await _off_loop(loop, self._executor, self._compute, computing)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed step changes no memory; fail its works, keep serving
            log.exception("step failed")
            self._in_flight = set()
            for p in plan.planned:
                self.fail(p.work, exc)
            return
        finally:
            self._in_flight = set()
        with threads_for(1):
            self.postprocess(plan, logits, start, time.perf_counter(), path, threads)

    def _inline(self, batch: ViewBatch) -> bool:
        """Whether this step's forward runs on the event loop (`INLINE_STEP_S`, `inline_step_s`)."""
        if batch.path != "fused":
            return False
        expected = self.threads.expected_seconds(batch.rows)
        return expected is not None and expected <= self.inline_step_s

    def _forward(self, batch: ViewBatch, inline: bool = False) -> tuple[ForwardResult, int]:
        """One forward pass and the threads it ran on: on the compute thread, or `inline` on the
        event loop (its torch ops on one thread, the C kernels on the step's count); holds the
        memory lock `_run` took for it."""
        try:
            threads = self.threads.choose(batch.rows)
            start = time.perf_counter()
            if inline:
                with loop_step_threads(threads):
                    result = self.runner.forward(batch)
            else:
                use_threads(threads)
                result = self.runner.forward(batch)
            self.threads.observe(batch.rows, threads, time.perf_counter() - start)
            return result, threads
        finally:
            self.ownership.memory_lock.release()

    def _compute(self, works: list[Work]) -> None:
        """Worker thread: the step's compute other than the forward pass (each work keeps its own
        result or failure)."""
        use_threads(self.threads.max_threads)
        for work in works:
            work.compute(self.runner)

    # ---- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._drop_overdue()
        self.budget.open_step()
        runnable = [w for w in self.works if w.runnable]
        from_cache = []
        for work in runnable:
            if isinstance(work, GenerateWork) and work.pending is None and work.next_logits is None:
                # logits cached by the view's last write spare the generation a peek step
                work.next_logits = self.runner.cached_logits(work.prefix())
                from_cache.append(work)
        choice = self.policy(runnable, self.config, self.shares, self.budget.admit)
        for work in choice.refused:
            self.fail(work, self.budget.refusal(work))
        chosen = [(w, n) for w, n in choice.chosen if not w.finished]
        computing = [w for w, _ in chosen if w.computes]
        if len(computing) > 1:  # one vision encode per step: a step's length stays bounded
            chosen = [(w, n) for w, n in chosen if not w.computes or w is computing[0]]
        if computing:  # its share of tower work, under the same latency bound as text prefill
            encode = computing[0]
            encode.plan_compute(encode.compute_budget(self.config, interactive_decoding(runnable)))
        for work in set(from_cache) - {w for w, _ in chosen}:
            work.next_logits = None  # not this step: the view may change before its turn
        self._sample([w for w, _ in chosen if isinstance(w, GenerateWork)])
        plan, now = StepPlan(), time.perf_counter()
        for work, n in chosen:
            items = self._items(work, n)
            if items is None:
                continue
            if work.first_scheduled is None:
                work.first_scheduled = now
                self.accounting.of(work.coroutine).queue_wait_s += now - work.submitted
                self._event(work, "scheduled", now - work.submitted)
            self.shares.charge(work, work.cost(n))
            read = sum(sum(b.length for b in i.view[:-1]) + i.block.length for i in items)
            plan.planned.append(Planned(work, n, items, read))
        return plan

    def _drop_overdue(self) -> None:
        """Fail every work past its deadline before it costs more compute (DeadlineExceededError)."""
        now = time.perf_counter()
        for work in [w for w in self.works if not w.finished and w.deadline is not None and now > w.deadline]:
            late = now - work.deadline
            self.fail(
                work,
                DeadlineExceededError(
                    f"{work.kind} of {work.coroutine!r} passed its deadline {late:.3f}s ago "
                    f"({work.served} tokens served)",
                    param="deadline",
                ),
            )

    def _sample(self, works: list[GenerateWork]) -> None:
        """The batched sampling stage: every chosen generation whose next token is not sampled yet
        and whose logits are known (from its last step, or cached after the view's last write).
        The others need a peek step first."""
        ready = [w for w in works if w.pending is None and w.next_logits is not None]
        if not ready:
            return
        picked = sample(_stacked([w.next_logits for w in ready]), [w.sampler for w in ready])
        for work, token in zip(ready, picked):
            try:
                work.accept(token)
            except CothinkError as exc:  # its constraint cannot go on (GrammarError): it fails alone
                self.fail(work, exc)

    def _items(self, work: Work, n: int) -> list[StepItem] | None:
        """The work's step items, checked against the context; None if the work ends here."""
        try:
            items = work.items(n, self.runner)
            for item in items:
                self.runner.check_context(item.view, item.positions_added, item.read_lengths)
            return items
        except InputTooLongError as exc:
            if isinstance(work, GenerateWork):  # the context is full: a generation ends there
                work.end("length")
                self._release_writer(work)
            else:
                self.fail(work, exc)
        except Exception as exc:  # a bad work fails alone; the step goes on without it
            self.fail(work, exc)
        return None

    # ---- postprocess ------------------------------------------------------------------------------
    def postprocess(
        self,
        plan: StepPlan,
        logits: list[torch.Tensor],
        start: float,
        end: float,
        path: str = "",
        threads: int = 0,
    ) -> None:
        records, row, counted = [], 0, set()
        for p in plan.planned:
            work, count = p.work, len(p.items)
            mine = logits[row : row + count]
            row += count
            if work.finished:  # cancelled while the step ran: its items were dropped, as if not run
                continue
            tokens = sum(len(i.token_ids) for i in p.items)
            self._account(p, tokens, counted)
            records.append(
                StepItemRecord(
                    work.coroutine,
                    work.kind,
                    tokens,
                    p.view_tokens + tokens,
                    work.priority.klass.name.lower(),
                    work.step_patch_blocks(),
                )
            )
            emitted_before = len(work.out.token_ids) if isinstance(work, GenerateWork) else 0
            sent_before = work.out.sent if isinstance(work, GenerateWork) else 0
            try:
                work.after_step(mine, self.runner)
            except Exception as exc:
                self.fail(work, exc)
                continue
            if isinstance(work, GenerateWork) and len(work.out.token_ids) > emitted_before:
                if emitted_before == 0:
                    ttft = time.perf_counter() - work.submitted
                    self.accounting.of(work.coroutine).ttft_s.append(ttft)
                    self._event(work, "first_token", ttft)
                text = work.out.text[sent_before : work.out.sent]
                self._event(work, "piece", len(work.out.token_ids) - emitted_before, text=text)
            if work.finished:
                self._release_writer(work)
                successor = work.successor()
                if successor is not None:  # it takes over the block at once: no other writer between
                    self.submit(successor, deadline=work.deadline)
                if self.auto_seal and isinstance(work, GenerateWork) and work.outcome in ("stop", "length"):
                    self.runner.seal(work.block)  # between steps: no forward pass is running
        self.steps += 1
        self.accounting.step(StepRecord(self.steps, start, end, tuple(records), path, threads))
        # Retire finished works now, before their callers resume: scratch blocks and holds go at once.
        for work in [w for w in self.works if w.finished]:
            self._retire(work)

    def _account(self, p: Planned, tokens: int, counted: set[str]) -> None:
        stats = self.accounting.of(p.work.coroutine)
        if p.work.coroutine not in counted:  # one forward pass per coroutine per step, however many works
            stats.forward_passes += 1
            counted.add(p.work.coroutine)
        stats.tokens_written += tokens
        stats.tokens_read += p.view_tokens + tokens
        p.work.served += tokens


async def _off_loop(
    loop: asyncio.AbstractEventLoop, executor: Executor, fn: Callable[..., T], *args: Any
) -> T:
    """fn(*args) on `executor`, awaited. Its outcome comes back in one `call_soon_threadsafe`, where
    `asyncio.shield(loop.run_in_executor(...))` took two more turns of the loop (measured on a 2-vCPU
    VM: ~70 us a step). If the awaiting task is cancelled (the engine stops), the job still runs to its end
    before the CancelledError goes on: nothing it reads is released under it."""
    done = loop.create_future()
    job = executor.submit(fn, *args)
    job.add_done_callback(lambda finished: loop.call_soon_threadsafe(_settle, done, finished))
    try:
        return await done
    except asyncio.CancelledError:
        await asyncio.wait([asyncio.wrap_future(job)])
        raise


def _settle(done: asyncio.Future, job: Future) -> None:
    """Hand a finished job's result or exception to the loop future awaiting it (unless cancelled)."""
    if done.cancelled():
        return
    exc = job.exception()
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(job.result())


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """The [R, vocab] rows as one tensor: a view where they are consecutive rows of one tensor (a
    step's logits, sampled in the order the step planned its generations), else a copy (32 rows of
    SmolLM2's logits: 6 MB, ~0.6 ms a step)."""
    first = rows[0]
    n, size = first.shape[-1], first.element_size()
    storage = first.untyped_storage().data_ptr()
    if first.dim() == 1 and first.stride(0) == 1 and all(
        r.dim() == 1 and r.stride(0) == 1 and r.shape[0] == n and r.untyped_storage().data_ptr() == storage
        and r.data_ptr() == first.data_ptr() + i * n * size and r.dtype == first.dtype
        for i, r in enumerate(rows)
    ):
        return first.as_strided((len(rows), n), (n, 1))
    return torch.stack(rows)
