"""Suite 5: long run. Coroutines are created, fed random input, interrupted and released in a loop.

Alongside the churn, an endless-stream workload: a monitor reads a never-ending, seeded log stream
through a `RollingContext` (the last blocks of the stream plus a summary block of what left), probing
an anomaly question as it goes.

Resident memory (psutil), KV pool usage, block bytes (`engine.memory().total_bytes_used`), live
blocks, running works, asyncio tasks, the stream's view position span and the engine's per-coroutine
bookkeeping are sampled over time. The suite fails if a series keeps growing over the second half of
the run (a fitted line, against a threshold), if the stream's view span exceeds its bound, or if
anything is left at the end (blocks, pages, works, tasks).
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from cothink.agents.rolling import RollingContext
from cothink.eval.common import (
    SuiteContext,
    SuiteResult,
    Table,
    Trend,
    detect_growth,
    engine_idle_state,
    fmt,
    within,
)
from cothink.eval.plots import lines
from cothink.eval.workload import document_tokens, random_token_ids

NAME = "soak"
TITLE = "Long-run stability: memory, blocks and tasks"
QUESTION = (
    "Over a long run with constant churn (coroutines created, fed, interrupted, released), does memory stay "
    "flat, and are blocks, pages, works and tasks all returned? And does a monitor reading an endless "
    "stream through a rolling context keep block memory, RSS and view positions bounded?"
)
METHOD = (
    "C sessions run at a time, for the given duration; each: a block reading a shared context, random input "
    "(random token ids), sometimes a fork, a sampled generation of a few tokens, sometimes a probe; 40% are "
    "interrupted (their task cancelled at a random moment); every session releases its blocks in `finally`. "
    "Sampled every 0.25 s (duration/600 in long runs): resident set size (RSS), used KV pages, live "
    "blocks, running works, asyncio tasks "
    "and entries in `engine.stats`. A line is fitted to each series over the second half of the run; growth "
    "over that half above a threshold = unbounded growth. The KV pool is pre-faulted (written once) so RSS "
    "measures leaks, not the pool's first touch. Alongside, in the same engine, an endless-stream monitor: "
    "a seeded, never-ending log stream (sensor readings, a fault line now and then) is appended line by "
    "line to a RollingContext (blocks of B tokens, at most W tokens kept; blocks that leave are folded by a "
    "summariser coroutine into a short summary block at the front of the view); every k lines the monitor "
    "probes [task, summary, *recent blocks] with an anomaly question and counts a finding when P(yes) "
    "crosses a threshold. Also sampled: `engine.memory().total_bytes_used` and the stream view's position "
    "span. Flat = fitted growth over the second half <= max(absolute tolerance, relative tolerance x the "
    "half's mean)."
)

TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class SoakPlan:
    """The soak's knobs (written verbatim into config.json and the suite's params)."""

    duration_s: float
    concurrency: int = 4  # sessions at a time
    kv_tokens: int = 4096  # the engine's pool
    shared_context: int = 256  # tokens of the context block every session reads
    # at most ~600 samples per series (a 30-minute run: one every 3 s), so the raw files stay small
    sample_every_s: float = 0.25
    interrupt_fraction: float = 0.4  # sessions whose task is cancelled at a random moment
    rss_abs_tol_mb: float = 32.0
    rss_rel_tol: float = 0.03
    # the endless-stream monitor (runs alongside the churn, in the same engine)
    stream: bool = True
    stream_block_tokens: int = 128  # B
    stream_max_tokens: int = 1024  # W: tokens the rolling view keeps
    stream_summary_tokens: int = 16
    stream_check_every: int = 4  # lines between anomaly probes
    stream_threshold: float = 0.5
    bytes_abs_tol_mb: float = 4.0  # block bytes: a few pages of noise from the churn
    bytes_rel_tol: float = 0.05


def plan(quick: bool, duration: float | None = None) -> SoakPlan:
    seconds = float(duration if duration is not None else (30.0 if quick else 600.0))
    return SoakPlan(
        duration_s=seconds,
        sample_every_s=max(0.25, seconds / 600),
        # quick: a smaller window, so that it turns over a few times within 30 s
        stream_block_tokens=64 if quick else 128,
        stream_max_tokens=256 if quick else 1024,
    )


def estimate_s(p: SoakPlan, speed: Any) -> float:
    return p.duration_s + 5


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


# ---- the endless stream ------------------------------------------------------------------------

STREAM_TASK = (
    "You monitor the live log of a plant's sensors. Each line is one reading: time, sensor, temperature, "
    "pressure, status. Report when something abnormal happens."
)
STREAM_QUESTION = "\nIs something abnormal happening in the log right now? Answer yes or no:"
SUMMARY_PROMPT = "\nSummary of the log so far:"


def stream_lines(seed: int) -> Iterator[str]:
    """A never-ending, deterministic sensor log; about one line in 40 is a fault."""
    rng = random.Random(seed * 7919 + 11)
    i = 0
    while True:
        sensor = rng.randrange(12)
        clock = f"{(i // 3600) % 24:02d}:{(i // 60) % 60:02d}:{i % 60:02d}"
        fault = rng.random() < 0.025
        temp = rng.uniform(85, 120) if fault else rng.uniform(18, 26)
        pressure = rng.uniform(2.5, 4) if fault else rng.uniform(0.9, 1.1)
        status = "FAULT" if fault else "ok"
        yield f"{clock} sensor-{sensor} temp={temp:.1f}C pressure={pressure:.2f}bar status={status}\n"
        i += 1


@dataclass
class StreamState:
    """What the stream monitor did, read by the sampler while it runs."""

    rolling: RollingContext | None = None
    task_tokens: int = 0
    question_tokens: int = 0
    lines: int = 0
    checks: int = 0
    findings: int = 0
    summaries: int = 0
    max_view_span: int = 0  # the longest view a probe read: task + summary + recent blocks + question
    appended_tokens: int = 0
    dropped_blocks: int = 0  # blocks that left the view (released): how often the window turned over
    yes_sum: float = 0.0  # sum of P(yes) over the probes (a running sum: the harness must not grow either)

    @property
    def span(self) -> int:
        """The position span of the monitor's view now (without the probe's question)."""
        return self.task_tokens + (self.rolling.position_span if self.rolling is not None else 0)

    def bound(self, p: SoakPlan) -> int:
        """The most a probe's view may span: the task, the summary, W kept tokens plus the block being
        filled, and the question."""
        return (
            self.task_tokens
            + p.stream_summary_tokens
            + p.stream_max_tokens
            + p.stream_block_tokens
            + self.question_tokens
        )


@dataclass
class _StreamMonitor:
    """The monitor reading the endless stream: its summariser and its anomaly probe."""

    engine: Any
    p: SoakPlan
    state: StreamState
    name: str = "stream-monitor"

    async def summarize(self, engine: Any, blocks: list[Any]) -> list[int]:
        # the summariser reads [previous summary, *blocks leaving the view] and writes a few tokens
        name = self.name
        scratch = engine.block(f"{name}-summary-scratch")
        try:
            view = [*blocks, scratch]
            await engine.extend(scratch, SUMMARY_PROMPT, view=view, name=f"{name}.summarizer")
            result = await engine.generate(
                view, max_tokens=self.p.stream_summary_tokens, stop_at_eos=False, name=f"{name}.summarizer"
            ).collect()
        finally:
            engine.release(scratch)
        self.state.summaries += 1
        return list(result.token_ids)

    async def probe(self, task: Any, rolling: RollingContext, question: list[int]) -> None:
        """Ask the anomaly question over [task, summary, *recent blocks]; count a finding over threshold."""
        state = self.state
        with rolling.reading() as recent:
            view = [task, *recent]
            state.max_view_span = max(state.max_view_span, sum(b.position_span for b in view) + len(question))
            probs = await self.engine.probe(view, question, (" yes", " no"), name=self.name)
        state.checks += 1
        yes = float(probs[" yes"])
        state.yes_sum += yes
        if yes >= self.p.stream_threshold:
            state.findings += 1

    async def run(self, seed: int, stop_at: float) -> None:
        engine, p, state, name = self.engine, self.p, self.state, self.name
        task = engine.block(f"{name}-task")
        rolling = RollingContext(
            engine,
            name,
            block_tokens=p.stream_block_tokens,
            max_tokens=p.stream_max_tokens,
            summarizer=self.summarize,
        )
        state.rolling = rolling
        question = list(engine.tokenizer.encode(STREAM_QUESTION, add_special_tokens=False))
        state.question_tokens = len(question)
        try:
            await engine.extend(task, STREAM_TASK, name=name)
            state.task_tokens = task.position_span
            for line in stream_lines(seed):
                if time.perf_counter() >= stop_at:
                    break
                await rolling.append(line)
                state.lines += 1
                if state.lines % p.stream_check_every == 0:
                    await self.probe(task, rolling, question)
        finally:
            state.appended_tokens = rolling.stats.appended_tokens
            state.dropped_blocks = rolling.stats.blocks_dropped
            state.rolling = None
            rolling.close()
            engine.release(task)


async def stream_monitor(engine: Any, p: SoakPlan, seed: int, stop_at: float, state: StreamState) -> None:
    """Read the endless stream through a RollingContext until stop_at, probing every k lines."""
    await _StreamMonitor(engine, p, state).run(seed, stop_at)


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample of the run (a row of raw/soak-<model>.csv)."""

    t: float  # seconds since the churn started
    rss_mb: float  # the process's resident set
    used_pages: int  # KV pool pages in use
    total_bytes_used: int  # engine.memory().total_bytes_used: bytes held by blocks
    stream_span: int  # the stream monitor's view span now (positions, without the question)
    stream_lines: int  # lines of the stream read so far
    live_blocks: int
    works: int  # running works
    tasks: int  # asyncio tasks
    stats_entries: int  # entries in engine.stats
    steps: int  # engine steps so far


def stream_trends(samples: Sequence[Sample], p: SoakPlan) -> dict[str, Trend]:
    """Flatness of RSS and block bytes over the second half: a line fitted to the second half; flat when
    its growth over that half <= max(absolute tolerance, relative tolerance x the half's mean)."""
    ts = [x.t for x in samples]
    return {
        "rss_mb": detect_growth(
            "rss_mb", ts, [x.rss_mb for x in samples], abs_tol=p.rss_abs_tol_mb, rel_tol=p.rss_rel_tol
        ),
        "total_bytes_used_mb": detect_growth(
            "total_bytes_used_mb",
            ts,
            [x.total_bytes_used / 2**20 for x in samples],
            abs_tol=p.bytes_abs_tol_mb,
            rel_tol=p.bytes_rel_tol,
        ),
    }


def during(samples: list[Sample], p: SoakPlan) -> list[Sample]:
    """The samples taken while the workload ran: the drain after it (sessions finishing, the stream
    closing) only lowers the series and would make a leak's fitted slope look smaller."""
    kept = [x for x in samples if x.t <= p.duration_s]
    return kept if len(kept) >= 4 else samples


def halves(times: Sequence[float], values: Sequence[float]) -> tuple[float, float, float, float]:
    """(mean, max) of a series over the first and the second half of the run."""
    if not times:
        return (float("nan"),) * 4
    t_mid = times[0] + (times[-1] - times[0]) / 2
    first = [v for t, v in zip(times, values) if t < t_mid] or [values[0]]
    second = [v for t, v in zip(times, values) if t >= t_mid] or [values[-1]]
    return sum(first) / len(first), max(first), sum(second) / len(second), max(second)


@dataclass
class _Churn:
    """One soak run's churn: sessions started, fed, interrupted and released until stop_at, sampled as
    it goes. Its fields are what the sessions, the sampler and the driving loop share."""

    ctx: SuiteContext
    p: SoakPlan
    engine: Any
    shared: Any  # the context block every session reads
    stream: StreamState
    leak_every: int
    t0: float
    vocab: int
    samples: list[Sample] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)
    leaked: list[Any] = field(default_factory=list)
    deadlock: bool = False

    @property
    def stop_at(self) -> float:
        return self.t0 + self.p.duration_s

    async def run(self) -> None:
        """The sampler, the stream monitor and the sessions, then a drain that leaves nothing running."""
        sampler_task = asyncio.create_task(self.sample_forever())
        stream_task = (
            asyncio.create_task(
                stream_monitor(self.engine, self.p, self.ctx.seed, self.stop_at, self.stream),
                name="stream-monitor",
            )
            if self.p.stream
            else None
        )
        running = await self.drive()
        await self.drain_sessions(running)
        if stream_task is not None:
            await self.drain_stream(stream_task)
        await asyncio.sleep(0.6)  # let scheduled cancels fire on finished tasks
        sampler_task.cancel()
        await asyncio.gather(sampler_task, return_exceptions=True)

    # ---- the sessions ----

    async def drive(self) -> set[asyncio.Task]:
        """Keep C sessions running until stop_at; returns those still running then."""
        p, counters = self.p, self.counters
        running: set[asyncio.Task] = set()
        interrupter_rng = random.Random(self.ctx.seed + 7)
        i = 0
        while time.perf_counter() < self.stop_at:
            while len(running) < p.concurrency:
                running.add(self.start_session(i, interrupter_rng))
                i += 1
            done, running = await asyncio.wait(running, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self.count_finished(task)
            self.ctx.say(
                f"{time.perf_counter() - self.t0:.0f}/{p.duration_s:.0f}s, {counters['sessions']} sessions"
            )
        return running

    def start_session(self, i: int, interrupter_rng: random.Random) -> asyncio.Task:
        """Start session i; a fraction of sessions get their task cancelled at a random moment."""
        task = asyncio.create_task(self.session(i), name=f"session-{i}")
        self.counters["sessions"] += 1
        if interrupter_rng.random() < self.p.interrupt_fraction:
            delay = interrupter_rng.uniform(0.0, 0.5)
            asyncio.get_running_loop().call_later(delay, task.cancel)
        return task

    def count_finished(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.counters["interrupted"] += 1
        elif task.exception() is not None:
            self.counters["errors"] += 1
            self.counters[f"error:{type(task.exception()).__name__}"] += 1

    async def session(self, i: int) -> None:
        """Read the shared context with random input; leak_every=k keeps every k-th session's blocks."""
        rng = random.Random(self.ctx.seed * 100_003 + i)
        blocks: list[Any] = []
        try:
            await self.feed(rng, f"session-{i}", blocks)
        finally:
            if self.leak_every and i % self.leak_every == 0:
                self.leaked.extend(blocks)
            else:
                for b in blocks:
                    self.engine.release(b)

    async def feed(self, rng: random.Random, name: str, blocks: list[Any]) -> None:
        """A block with random input, sometimes a fork, sometimes a probe, then a short sampled generation.
        Blocks go into `blocks` as soon as they exist, so that an interrupt still releases them."""
        engine, shared, counters = self.engine, self.shared, self.counters
        block = engine.block(name)
        blocks.append(block)
        await engine.extend(
            block,
            token_ids=random_token_ids(rng, self.vocab, rng.randint(8, 48)),
            view=[shared, block],
            name=name,
        )
        counters["extends"] += 1
        view = [shared, block]
        if rng.random() < 0.2:
            view = await self.fork(rng, name, block, blocks)
        if rng.random() < 0.3:
            await engine.probe(
                view, random_token_ids(rng, self.vocab, rng.randint(2, 8)), (" yes", " no"), name=name
            )
            counters["probes"] += 1
        result = await engine.generate(
            view,
            max_tokens=rng.randint(2, 8),
            temperature=0.8,
            seed=rng.randrange(1 << 30),
            name=name,
        ).collect()
        counters["tokens"] += len(result.token_ids)
        counters["generations"] += 1

    async def fork(self, rng: random.Random, name: str, block: Any, blocks: list[Any]) -> list[Any]:
        """Fork the session's block and feed the fork; returns the view that reads it."""
        fork = self.engine.fork(block, f"{name}-fork")
        blocks.append(fork)
        await self.engine.extend(
            fork,
            token_ids=random_token_ids(rng, self.vocab, rng.randint(2, 16)),
            view=[self.shared, fork],
            name=name,
        )
        self.counters["forks"] += 1
        return [self.shared, fork]

    # ---- the end of the run ----

    async def drain_sessions(self, running: set[asyncio.Task]) -> None:
        """Wait for the sessions still running; any still pending after the timeout is a deadlock."""
        if not running:
            return
        done, pending = await asyncio.wait(running, timeout=TIMEOUT)
        self.deadlock = bool(pending)
        for task in done:
            if task.cancelled():
                self.counters["interrupted"] += 1

    async def drain_stream(self, stream_task: asyncio.Task) -> None:
        done, _ = await asyncio.wait({stream_task}, timeout=TIMEOUT)
        if not done:
            self.deadlock = True
            stream_task.cancel()
            await asyncio.gather(stream_task, return_exceptions=True)
        elif stream_task.exception() is not None:
            self.counters["errors"] += 1
            self.counters[f"error:stream:{type(stream_task.exception()).__name__}"] += 1

    # ---- the sampler ----

    async def sample_forever(self) -> None:
        while True:
            self.samples.append(self.sample())
            await asyncio.sleep(self.p.sample_every_s)

    def sample(self) -> Sample:
        engine = self.engine
        mem = engine.memory()
        return Sample(
            t=time.perf_counter() - self.t0,
            rss_mb=rss_mb(),
            used_pages=mem.used_pages,
            total_bytes_used=mem.total_bytes_used,
            stream_span=self.stream.span,
            stream_lines=self.stream.lines,
            live_blocks=mem.live_blocks,
            works=engine.occupancy().works,
            tasks=len(asyncio.all_tasks()),
            stats_entries=len(engine.stats),
            steps=engine.steps,
        )


@dataclass(frozen=True)
class SoakRun:
    """What one soak run measured: the samples, the engine's state before and after, the churn."""

    samples: list[Sample]
    start: dict[str, int]  # engine_idle_state before the churn
    end: dict[str, int]  # and after it (the shared context released)
    start_tasks: int  # asyncio tasks before and after
    end_tasks: int
    counters: dict[str, int]  # sessions, interrupted, errors (and error:<type>), extends, forks, ...
    deadlock: bool  # a session or the stream did not finish within TIMEOUT
    leaked_blocks: int  # blocks kept on purpose (leak_every)
    stats_growth: int  # entries engine.stats gained over the run
    stats_entries: int  # and holds at the end
    stats_cap: int  # engine.limits.max_tracked_coroutines
    pool_pages: int
    stream: StreamState | None  # None when the plan runs no stream

    @property
    def steps(self) -> int:
        return self.samples[-1].steps if self.samples else 0


async def soak(ctx: SuiteContext, p: SoakPlan, *, leak_every: int = 0) -> SoakRun:
    """Run the churn; leak_every=k keeps every k-th session's blocks (an injected leak, for tests)."""
    m = ctx.model
    engine = m.engine(kv_tokens=p.kv_tokens)
    pool = engine.runner.store.pool
    pool.k.zero_()  # pre-fault: first touch of pool pages is not a leak
    pool.v.zero_()
    async with engine:
        start = engine_idle_state(engine)
        start_tasks = len(asyncio.all_tasks())
        start_stats = len(engine.stats)
        stream = StreamState()
        shared = engine.block("shared-context")
        await within(
            engine.extend(shared, token_ids=document_tokens(m, ctx.seed, p.shared_context), name="setup"),
            TIMEOUT,
            "shared context",
        )
        churn = _Churn(ctx, p, engine, shared, stream, leak_every, time.perf_counter(), m.config.vocab_size)
        await churn.run()
        engine.release(shared)
        await asyncio.sleep(0)
        gc.collect()
        end = engine_idle_state(engine)
        end_tasks = len(asyncio.all_tasks())
        end_stats = len(engine.stats)
    return SoakRun(
        samples=churn.samples,
        start=start,
        end=end,
        start_tasks=start_tasks,
        end_tasks=end_tasks,
        counters=dict(churn.counters),
        deadlock=churn.deadlock,
        leaked_blocks=len(churn.leaked),
        stats_growth=end_stats - start_stats,
        stats_entries=end_stats,
        stats_cap=engine.limits.max_tracked_coroutines,
        pool_pages=pool.num_pages,
        stream=stream if p.stream else None,
    )


@dataclass(frozen=True, slots=True)
class StreamVerdict:
    """The endless stream's bound and how far the window turned over."""

    bound: int  # the most a probe's view may span (StreamState.bound)
    max_span: int  # the longest view a probe read or a sample saw (with the question)
    turnovers: float  # tokens appended / W: under 2, flat memory proves nothing

    @property
    def span_bounded(self) -> bool:
        return self.max_span <= self.bound


@dataclass(frozen=True, slots=True)
class Verdicts:
    """Trend per series and the end-of-run state."""

    trends: dict[str, Trend]  # rss_mb, total_bytes_used_mb, used_pages, live_blocks, tasks
    end_clean: bool  # no block, page, work, writer or hold left
    tasks_clean: bool  # as many asyncio tasks as at the start
    stream: StreamVerdict | None


def verdicts(run: SoakRun, p: SoakPlan) -> Verdicts:
    """Trend per series and the end-of-run state (shared with the tests)."""
    s = during(run.samples, p)
    ts = [x.t for x in s]
    trends = {
        **stream_trends(s, p),
        "used_pages": detect_growth(
            "used_pages", ts, [x.used_pages for x in s], abs_tol=max(4.0, 0.1 * run.pool_pages)
        ),
        "live_blocks": detect_growth(
            "live_blocks", ts, [x.live_blocks for x in s], abs_tol=2.0 * p.concurrency + 2
        ),
        "tasks": detect_growth("tasks", ts, [x.tasks for x in s], abs_tol=p.concurrency + 2),
    }
    end_clean = (
        run.end["live_blocks"] == run.start["live_blocks"]
        and run.end["used_pages"] == run.start["used_pages"]
        and run.end["works"] == 0
        and run.end["writers"] == 0
        and run.end["holds"] == 0
    )
    stream = None
    if run.stream is not None:
        state = run.stream
        stream = StreamVerdict(
            bound=state.bound(p),
            max_span=max([state.max_view_span] + [x.stream_span + state.question_tokens for x in s]),
            # the window must have turned over several times, or flat memory would prove nothing
            turnovers=state.appended_tokens / p.stream_max_tokens,
        )
    return Verdicts(trends, end_clean, run.end_tasks == run.start_tasks, stream)


async def run(ctx: SuiteContext, p: SoakPlan) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=asdict(p))
    r = await soak(ctx, p)
    v = verdicts(r, p)
    res.records = [asdict(x) for x in r.samples]
    _churn_report(res, r, v)
    if r.stream is not None and v.stream is not None:
        _stream_report(res, r, v.stream, p, r.stream)
    _health_checks(res, r, v)
    _plot(ctx, res, r, p)
    _summarize(res, r, v, p)
    return res


def _churn_report(res: SuiteResult, r: SoakRun, v: Verdicts) -> None:
    """The sampled series' trends, the churn counters, the engine's state at start and end."""
    res.tables += [_trends_table(v), _churn_table(r), _state_table(r)]
    for name, t in v.trends.items():
        res.check(
            f"{name} bounded (growth over the second half <= {t.allowed:.3g})",
            not t.leaking,
            f"fitted growth {t.growth:.3g}",
        )


def _trends_table(v: Verdicts) -> Table:
    rows = [
        [
            t.name,
            fmt(t.first),
            fmt(t.last),
            fmt(t.slope_per_s * 60, 3),
            fmt(t.growth, 3),
            fmt(t.allowed, 3),
            "GROWING" if t.leaking else "bounded",
        ]
        for t in v.trends.values()
    ]
    return Table(
        "Sampled series (second-half fit)",
        ["series", "first", "last", "slope per minute", "growth over 2nd half", "allowed", "verdict"],
        rows,
    )


_CHURN_COUNTERS = ("sessions", "interrupted", "errors", "extends", "forks", "probes", "generations", "tokens")


def _churn_table(r: SoakRun) -> Table:
    return Table(
        "Churn",
        [*(k if k != "tokens" else "tokens generated" for k in _CHURN_COUNTERS), "engine steps"],
        [[*(r.counters.get(k, 0) for k in _CHURN_COUNTERS), r.steps]],
    )


_STATE_FIELDS = ("live_blocks", "used_pages", "free_pages", "works", "writers", "holds")


def _state_table(r: SoakRun) -> Table:
    return Table(
        "Engine state",
        [
            "when",
            "live blocks",
            "used pages",
            "free pages",
            "works",
            "writers",
            "held blocks",
            "asyncio tasks",
        ],
        [
            ["start", *(r.start[k] for k in _STATE_FIELDS), r.start_tasks],
            ["end", *(r.end[k] for k in _STATE_FIELDS), r.end_tasks],
        ],
    )


def _stream_report(res: SuiteResult, r: SoakRun, v: StreamVerdict, p: SoakPlan, stream: StreamState) -> None:
    """The endless stream: memory first half vs second half, the monitor's counters, its checks."""
    rows = []
    samples = during(r.samples, p)
    ts = [x.t for x in samples]
    for values, label, scale in (
        ([x.rss_mb for x in samples], "RSS (MiB)", 1.0),
        ([x.total_bytes_used for x in samples], "total_bytes_used (MiB)", 2**-20),
        ([x.stream_span for x in samples], "stream view span (positions)", 1.0),
    ):
        m1, x1, m2, x2 = halves(ts, values)
        rows.append([label, fmt(m1 * scale), fmt(x1 * scale), fmt(m2 * scale), fmt(x2 * scale)])
    res.tables.append(
        Table(
            "Endless stream: first half vs second half",
            ["series", "mean, 1st half", "max, 1st half", "mean, 2nd half", "max, 2nd half"],
            rows,
        )
    )
    mean_p = stream.yes_sum / stream.checks if stream.checks else None
    res.tables.append(
        Table(
            "Endless stream monitor",
            [
                "lines read",
                "tokens appended",
                "window turnovers",
                "blocks dropped",
                "summaries",
                "probes",
                "findings",
                "mean P(yes)",
                "max view span",
                "span bound",
            ],
            [
                [
                    stream.lines,
                    stream.appended_tokens,
                    fmt(v.turnovers, 3),
                    stream.dropped_blocks,
                    stream.summaries,
                    stream.checks,
                    stream.findings,
                    fmt(mean_p),
                    v.max_span,
                    v.bound,
                ]
            ],
            note="window turnovers = tokens appended / tokens kept (W); a finding = P(yes) >= "
            f"{p.stream_threshold}",
        )
    )
    res.check(
        "endless stream: view position span bounded (max <= task + summary + W + B + question)",
        v.span_bounded,
        f"max {v.max_span}, bound {v.bound}",
    )
    res.check(
        "endless stream: the window turned over at least twice (else flat memory proves nothing)",
        v.turnovers >= 2.0,
        f"{stream.appended_tokens} tokens appended, W = {p.stream_max_tokens}",
        soft=True,  # inconclusive (a run too short), not a leak
    )


def _health_checks(res: SuiteResult, r: SoakRun, v: Verdicts) -> None:
    res.check("no block, page, work or hold left at the end", v.end_clean, str(r.end))
    res.check("no asyncio task left at the end", v.tasks_clean, f"{r.start_tasks} -> {r.end_tasks}")
    res.check("no session hung (all finished within the timeout)", not r.deadlock)
    errs = {k: n for k, n in r.counters.items() if k.startswith("error:")}
    res.check("no session failed with an error", not errs, str(errs))
    res.check(
        "engine.stats stays bounded (at most max_tracked_coroutines entries, oldest dropped)",
        r.stats_entries <= r.stats_cap,
        f"{r.stats_growth} entries added, {r.stats_entries} held, cap {r.stats_cap}",
    )


def _plot(ctx: SuiteContext, res: SuiteResult, r: SoakRun, p: SoakPlan) -> None:
    samples = r.samples
    ts = [x.t for x in samples]
    lines(
        ctx.plot_path(NAME, "series"),
        f"{ctx.model.key}: soak ({p.duration_s:.0f}s)",
        "seconds",
        [
            ("RSS (MiB)", [("rss", ts, [x.rss_mb for x in samples])]),
            ("KV pages used", [("used pages", ts, [x.used_pages for x in samples])]),
            ("block memory (MiB)", [("total_bytes_used", ts, [x.total_bytes_used / 2**20 for x in samples])]),
            ("positions", [("stream view span", ts, [x.stream_span for x in samples])]),
            (
                "count",
                [
                    ("live blocks", ts, [x.live_blocks for x in samples]),
                    ("works", ts, [x.works for x in samples]),
                    ("asyncio tasks", ts, [x.tasks for x in samples]),
                ],
            ),
        ],
        marker="",
    )
    res.plots.append(ctx.plot_path(NAME, "series").name)


def _summarize(res: SuiteResult, r: SoakRun, v: Verdicts, p: SoakPlan) -> None:
    c = r.counters
    tr = v.trends
    res.summary = (
        f"{p.duration_s:.0f} s, {c.get('sessions', 0)} sessions ({c.get('interrupted', 0)} interrupted): "
        f"RSS {tr['rss_mb'].first:.0f} -> {tr['rss_mb'].last:.0f} MiB (2nd-half growth "
        f"{tr['rss_mb'].growth:.1f} MiB), end state {'clean' if v.end_clean else 'NOT clean'}, "
        f"tasks {r.start_tasks} -> {r.end_tasks}, engine.stats +{r.stats_growth} entries"
    )
    res.headline.update(
        {
            "duration_s": p.duration_s,
            "sessions": c.get("sessions", 0),
            "interrupted": c.get("interrupted", 0),
            "rss_growth_2nd_half_mb": tr["rss_mb"].growth,
            "rss_first_mb": tr["rss_mb"].first,
            "rss_last_mb": tr["rss_mb"].last,
            "end_clean": v.end_clean,
            "stats_entries_added": r.stats_growth,
            "total_bytes_growth_2nd_half_mb": tr["total_bytes_used_mb"].growth,
        }
    )
    res.conditions += [
        f"{p.duration_s:.0f} s, {p.concurrency} concurrent sessions, pool of {p.kv_tokens} tokens; "
        "a short run cannot reveal leaks that only show over days (the framework's 7x24 run): use "
        "`--duration` for longer soaks",
        f"thresholds: RSS {p.rss_abs_tol_mb:.0f} MiB or {p.rss_rel_tol:.0%} over the second half; "
        "pages 10% "
        "of the pool; live blocks 2C+2; total_bytes_used "
        f"{p.bytes_abs_tol_mb:.0f} MiB or {p.bytes_rel_tol:.0%} over the second half",
    ]
    if r.stream is not None and v.stream is not None:
        _summarize_stream(res, r.stream, v, p)


def _summarize_stream(res: SuiteResult, stream: StreamState, v: Verdicts, p: SoakPlan) -> None:
    assert v.stream is not None
    b = v.trends["total_bytes_used_mb"]
    res.summary += (
        f"; endless stream: {stream.lines} lines ({stream.appended_tokens} tokens, "
        f"{v.stream.turnovers:.0f} window turnovers), total_bytes_used 2nd-half growth "
        f"{b.growth:.2f} MiB (allowed {b.allowed:.2f}), max view span {v.stream.max_span} "
        f"(bound {v.stream.bound})"
    )
    res.headline.update(
        {
            "stream_lines": stream.lines,
            "stream_tokens": stream.appended_tokens,
            "stream_turnovers": v.stream.turnovers,
            "stream_summaries": stream.summaries,
            "stream_probes": stream.checks,
            "stream_findings": stream.findings,
            "stream_max_view_span": v.stream.max_span,
            "stream_span_bound": v.stream.bound,
        }
    )
    res.conditions.append(
        f"endless stream: blocks of {p.stream_block_tokens} tokens, {p.stream_max_tokens} "
        f"tokens kept, a {p.stream_summary_tokens}-token summary, a probe every "
        f"{p.stream_check_every} lines; it shares the engine (and the CPU) with the churn, so "
        "total_bytes_used includes the churn's blocks; the stream's anomaly answers are not scored "
        "(a memory test, not an accuracy test)"
    )
