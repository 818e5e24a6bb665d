"""Suite 2: foreground latency and jitter while background coroutines run, against turn-based serving.

A foreground user sends short requests one after another (closed loop); N background coroutines keep
generating (each: read a prompt, generate, start over). cothink runs them all concurrently in one
engine, with the fairness policy (foreground 'interactive') and without it (foreground 'background',
i.e. one priority class for all). The turn-based baseline runs the same clients against a server that
serves one request at a time (foreground requests jump the queue at request boundaries: the kindest
turn-based policy).

Besides the times, the suite reads the engine's step timeline, so its central verdict does not depend
on the machine: while the interactive foreground decodes, every step carries at most
`interactive_step_tokens` tokens, background work included, and each foreground prompt is served
within the policy's bound on steps (`scheduler/policy.py`). A scheduler that ignores priority classes
fails the first on any machine. The suite also runs a streamed-input workload (`cothink.eval.streamed`),
reports the knee of the throughput ramp and, with `--script`, a user's workload (`cothink.eval.script`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cothink.eval.common import (
    Knee,
    RampPoint,
    SuiteContext,
    SuiteResult,
    Table,
    fmt,
    knee,
    min_samples,
    plan_params,
    sampled_percentile,
    within,
)
from cothink.eval.plots import lines
from cothink.eval.script import EventResult, load_script, run_script
from cothink.eval.streamed import StreamPlan, UtteranceRow, run_streamed
from cothink.eval.workload import filler_words

NAME = "latency"
TITLE = "Streaming latency and jitter under concurrency"
QUESTION = (
    "Is first-response and end-to-end latency of a foreground coroutine under control while background "
    "coroutines run, how much does it jitter, is it served in priority order, and what does concurrency "
    "cost or buy against turn-based serving (one request after another) on the same weights?"
)
METHOD = (
    "Foreground: R requests in a closed loop (chat prompt, greedy, fixed number of new tokens). Background: "
    "N coroutines, each looping over jobs (prompt of P tokens, generate G tokens). Modes: **cothink fair** "
    "(foreground priority 'interactive'), **cothink one class** (foreground priority 'background', the "
    "policy's class separation off), **turn-based** (one request at a time; foreground requests are served "
    "next when the current request ends). TTFT = request submitted -> first new token; end-to-end = "
    "submitted -> last token; jitter = inter-token intervals of the foreground stream. Throughput = all "
    "tokens generated (foreground + background) per second during the foreground's window. Every "
    "percentile is given with its sample count n and only when n is at least 4 (p50), 40 (p95) or 200 "
    "(p99). Order of service is read from the engine's step timeline. The throughput ramp (cothink fair, "
    "concurrency N+1) gives the knee. **Streamed input**: a listener receives utterances as half-words "
    "every few tens of ms and appends them to a block while a background thinker generates, then answers."
)

TIMEOUT = 900.0
PROMPT = "Reply in a few words: what is {a} plus {b}?"


@dataclass(frozen=True, slots=True)
class LatencyPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    background: tuple[int, ...]  # N: background jobs at each point of the sweep
    requests: int  # foreground requests per point
    fg_tokens: int  # tokens per foreground request: requests x (fg_tokens - 1) inter-token gaps per point
    bg_prompt: int
    bg_tokens: int
    gap_s: float
    knee_gain: float = 0.10  # the ramp's knee: throughput gain per doubling of concurrency below this
    stream: StreamPlan | None = None  # the streamed-input workload; None: not run
    script: str | None = None  # a user's workload script (--script); None: none


def plan(quick: bool, duration: float | None = None) -> LatencyPlan:
    if quick:
        return LatencyPlan(
            background=(0, 2, 8),
            requests=10,
            fg_tokens=24,
            bg_prompt=48,
            bg_tokens=16,
            gap_s=0.05,
            stream=StreamPlan(utterances=4, words=10, piece_s=0.05, answer_tokens=4, thinker_tokens=32),
        )
    return LatencyPlan(
        background=(0, 1, 2, 4, 8, 16, 32),
        requests=16,
        fg_tokens=32,
        bg_prompt=96,
        bg_tokens=32,
        gap_s=0.1,
        stream=StreamPlan(utterances=8, words=16, piece_s=0.05, answer_tokens=8, thinker_tokens=64),
    )


def _estimate_raw(p: LatencyPlan, speed) -> float:
    total = 0.0
    per_req = 20 / speed.prefill_tps + p.fg_tokens * speed.step_s
    bg_job = p.bg_prompt / speed.prefill_tps + p.bg_tokens * speed.step_s
    for n in p.background:
        conc = p.requests * (p.fg_tokens + 2) * speed.step_s * (1 + 0.35 * n)
        total += conc * (2 if n else 1)
        total += p.requests * (per_req + (bg_job if n else 0)) + (bg_job if n else 0)
    if p.stream is not None:
        s = p.stream
        total += s.utterances * (2 * s.words * s.piece_s + s.answer_tokens * speed.step_s * 2)
    return total


def estimate_s(p: LatencyPlan, speed) -> float:
    """Seconds, from the calibrated speed; the factor was fitted to measured quick runs on a 2-core CPU."""
    return 2.0 * _estimate_raw(p, speed)


class TurnServer:
    """One request at a time, in priority order (0 first), FIFO within a priority."""

    def __init__(self) -> None:
        self.queue: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self._seq = itertools.count()

    async def submit(self, priority: int, job):
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((priority, next(self._seq), job, fut))
        return await fut

    async def serve(self) -> None:
        while True:
            _, _, job, fut = await self.queue.get()
            try:
                fut.set_result(await job())
            except Exception as exc:  # report to the client, keep serving
                if not fut.done():
                    fut.set_exception(exc)


@dataclass
class _ForegroundRequest:
    submitted: float
    times: list[float]  # when each of its tokens arrived
    error: str = ""  # why it did not complete ("" when it did)


@dataclass
class _LatencyRun:
    """One measurement point: a foreground client and n_bg background clients in one engine, served
    concurrently (cothink) or one request at a time (server: the turn-based baseline)."""

    engine: Any
    p: LatencyPlan
    n_bg: int
    fg_priority: str
    bg_prompts: list[list[int]]
    fg_prompts: list[list[int]]
    server: TurnServer | None = None
    token_times: list[float] = field(default_factory=list)  # every generated token, foreground and background
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    requests: list[_ForegroundRequest] = field(default_factory=list)
    bg_errors: list[str] = field(default_factory=list)  # background jobs that failed

    async def run_job(self, prompt: list[int], max_tokens: int, name: str, priority: str) -> list[float]:
        """Read the prompt into a fresh block and stream max_tokens; returns each token's arrival time."""
        engine = self.engine
        block = engine.block(name)
        times: list[float] = []
        try:
            await engine.extend(block, token_ids=prompt, name=name, priority=priority)
            async for piece in engine.generate(
                block, max_tokens=max_tokens, stop_at_eos=False, name=name, priority=priority
            ):
                now = time.perf_counter()
                times.extend([now] * len(piece.token_ids))
                self.token_times.extend([now] * len(piece.token_ids))
                if self.stop.is_set() and priority == "background" and name.startswith("bg"):
                    break
        finally:
            engine.release(block)
        return times

    async def serve(self, queue_priority: int, prompt: list[int], max_tokens: int, name: str, priority: str):
        """A job straight into the engine, or through the turn-based server's queue (0 = served first)."""
        if self.server is None:
            return await self.run_job(prompt, max_tokens, name, priority)
        return await self.server.submit(
            queue_priority, functools.partial(self.run_job, prompt, max_tokens, name, priority)
        )

    async def background_client(self, i: int) -> None:
        for j in itertools.count():
            if self.stop.is_set():
                return
            prompt = self.bg_prompts[(i * 7 + j) % len(self.bg_prompts)]
            try:
                await self.serve(1, prompt, self.p.bg_tokens, f"bg{i}", "background")
            except Exception as exc:  # counted by the suite's check; the client goes on
                self.bg_errors.append(f"{type(exc).__name__}: {exc}")

    async def wait_for_background(self) -> None:
        """Let the background get going: a token from each client, or two minutes."""
        if self.n_bg:
            t0 = time.perf_counter()
            while len(self.token_times) < self.n_bg and time.perf_counter() - t0 < 120:
                await asyncio.sleep(0.01)

    async def foreground(self) -> None:
        """The closed loop: a request, its whole answer, a short gap, the next request. A request that
        fails or times out is recorded with its error; the loop goes on."""
        p = self.p
        for r in range(p.requests):
            submitted = time.perf_counter()
            try:
                times = await within(
                    self.serve(0, self.fg_prompts[r], p.fg_tokens, "fg", self.fg_priority), TIMEOUT, "fg"
                )
                self.requests.append(_ForegroundRequest(submitted, times))
            except Exception as exc:
                self.requests.append(_ForegroundRequest(submitted, [], f"{type(exc).__name__}: {exc}"))
            await asyncio.sleep(p.gap_s)

    async def run(self) -> tuple[float, float]:
        """Run the point in the (started) engine; returns the foreground's window (start, end)."""
        server_task = asyncio.create_task(self.server.serve()) if self.server else None
        bg_tasks = [asyncio.create_task(self.background_client(i)) for i in range(self.n_bg)]
        await self.wait_for_background()
        window_start = time.perf_counter()
        await self.foreground()
        window_end = max((t for r in self.requests for t in r.times[-1:]), default=time.perf_counter())
        self.stop.set()
        await within(asyncio.gather(*bg_tasks), TIMEOUT, "background clients")
        if server_task:
            server_task.cancel()
            await asyncio.gather(server_task, return_exceptions=True)
        return window_start, window_end


@dataclass(frozen=True, slots=True)
class ServiceOrder:
    """How the engine served the foreground, read from its step timeline (counts of steps)."""

    cap: int  # interactive_step_tokens: the most tokens a step may carry while an interactive decode runs
    decode_steps: int  # steps that carried a foreground generation's token
    shared_steps: int  # of those, steps that also carried another coroutine's work
    over_cap: int  # of those, steps that carried more than `cap` tokens in all
    max_step_tokens: int  # the largest of those steps, in tokens
    prompt_bound: int  # steps within which the policy serves one foreground prompt
    prompt_steps_max: int  # the most steps one foreground prompt took


def _service_order(engine: Any, requests: list[_ForegroundRequest], prompt_tokens: int) -> ServiceOrder:
    cfg = engine.limits.scheduler
    steps = list(engine.timeline)
    decode = [s for s in steps if any(i.coroutine == "fg" and i.kind == "generate" for i in s.items)]
    chunk = min(cfg.max_prefill_chunk, cfg.max_batch_tokens - cfg.background_min_tokens)
    prompt_steps = [
        sum(
            1
            for s in steps
            if r.submitted <= s.start
            and s.end <= r.times[0]
            and any(i.coroutine == "fg" and i.kind == "extend" for i in s.items)
        )
        for r in requests
        if r.times
    ]
    return ServiceOrder(
        cap=cfg.interactive_step_tokens,
        decode_steps=len(decode),
        shared_steps=sum(1 for s in decode if any(i.coroutine != "fg" for i in s.items)),
        over_cap=sum(1 for s in decode if s.tokens > cfg.interactive_step_tokens),
        max_step_tokens=max((s.tokens for s in decode), default=0),
        prompt_bound=math.ceil(prompt_tokens / chunk),
        prompt_steps_max=max(prompt_steps, default=0),
    )


@dataclass(frozen=True, slots=True)
class LatencyRow:
    """One point of the sweep: a row of raw/latency-<model>.csv (latencies in seconds; a percentile is
    NaN when its sample count is below what it needs: 4 for p50, 40 for p95, 200 for p99)."""

    mode: str  # "fair", "one-class" or "turn-based"
    background: int  # N: background coroutines
    requests: int  # foreground requests sent
    completed: int  # of those, answered with all their tokens
    bg_errors: int  # background jobs that failed
    throughput_tok_s: float  # all tokens generated per second of the foreground's window
    fg_tok_s: float  # foreground tokens per second of foreground end-to-end time
    window_s: float  # the foreground's window: first request -> last token
    ttft_n: int  # samples: one per completed request
    ttft_p50: float  # time to first token
    ttft_p95: float
    ttft_p99: float
    e2e_p50: float  # submitted -> last token (ttft_n samples)
    e2e_p95: float
    e2e_p99: float
    itl_n: int  # samples: inter-token gaps of the foreground streams
    itl_p50: float
    itl_p95: float
    itl_p99: float
    service: ServiceOrder
    errors: list[str]  # the foreground's and the background's, at most 5
    ttft_all: list[float]  # every completed foreground request's TTFT
    e2e_all: list[float]  # and end-to-end time


Results = dict[tuple[str, int], LatencyRow]  # (mode, N) -> that point's row


async def _measure(ctx: SuiteContext, p: LatencyPlan, n_bg: int, mode: str) -> LatencyRow:
    m = ctx.model
    engine = m.engine(kv_tokens=max(4096, (n_bg + 2) * (p.bg_prompt + p.bg_tokens + 64) * 2))
    rng = random.Random(ctx.seed + n_bg)
    point = _LatencyRun(
        engine,
        p,
        n_bg,
        fg_priority="background" if mode == "one-class" else "interactive",
        bg_prompts=[m.encode("Log: " + filler_words(rng, p.bg_prompt))[: p.bg_prompt] for _ in range(16)],
        fg_prompts=[m.chat(PROMPT.format(a=i + 2, b=i + 3)) for i in range(p.requests)],
    )
    async with engine:
        point.server = TurnServer() if mode == "turn-based" else None
        window_start, window_end = await point.run()
        service = _service_order(engine, point.requests, max(len(x) for x in point.fg_prompts))
    done = [r for r in point.requests if not r.error and len(r.times) == p.fg_tokens]
    ttft = [r.times[0] - r.submitted for r in done]
    e2e = [r.times[-1] - r.submitted for r in done]
    itl = [b - a for r in done for a, b in zip(r.times, r.times[1:])]
    in_window = sum(1 for t in point.token_times if window_start <= t <= window_end)
    window = window_end - window_start
    errors = [r.error or f"{len(r.times)} of {p.fg_tokens} tokens" for r in point.requests if r not in done]
    return LatencyRow(
        mode=mode,
        background=n_bg,
        requests=len(point.requests),
        completed=len(done),
        bg_errors=len(point.bg_errors),
        throughput_tok_s=in_window / window if window > 0 else math.nan,
        fg_tok_s=len(done) * p.fg_tokens / sum(e2e) if e2e else math.nan,
        window_s=window,
        ttft_n=len(ttft),
        ttft_p50=sampled_percentile(ttft, 50).value,
        ttft_p95=sampled_percentile(ttft, 95).value,
        ttft_p99=sampled_percentile(ttft, 99).value,
        e2e_p50=sampled_percentile(e2e, 50).value,
        e2e_p95=sampled_percentile(e2e, 95).value,
        e2e_p99=sampled_percentile(e2e, 99).value,
        itl_n=len(itl),
        itl_p50=sampled_percentile(itl, 50).value,
        itl_p95=sampled_percentile(itl, 95).value,
        itl_p99=sampled_percentile(itl, 99).value,
        service=service,
        errors=(errors + point.bg_errors)[:5],
        ttft_all=ttft,
        e2e_all=e2e,
    )


MODES = ("fair", "one-class", "turn-based")


@dataclass
class _Measured:
    """Everything one run of the suite measured."""

    points: Results
    stream: list[UtteranceRow]
    script: list[EventResult]


async def run(ctx: SuiteContext, p: LatencyPlan) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=plan_params(p))
    script = load_script(p.script) if p.script else None
    results: Results = {}
    for n_bg in p.background:
        for mode in MODES:
            if mode == "one-class" and n_bg == 0:
                continue  # nothing to compete with: identical to 'fair'
            ctx.say(f"{mode}, {n_bg} background")
            results[(mode, n_bg)] = await _measure(ctx, p, n_bg, mode)
    stream: list[UtteranceRow] = []
    if p.stream is not None:
        ctx.say("streamed input")
        stream = await run_streamed(ctx.model, p.stream, ctx.seed)
    events: list[EventResult] = []
    if script is not None:
        ctx.say(f"script {script.name}")
        engine = ctx.model.engine(kv_tokens=8192)
        async with engine:
            events = await run_script(ctx.model, engine, script, timeout_s=TIMEOUT)
    measured = _Measured(results, stream, events)
    res.records = [{"workload": "sweep", **asdict(r)} for r in results.values()]
    res.records += [{"workload": "streamed input", **asdict(r)} for r in stream]
    res.records += [{"workload": "script", **asdict(e)} for e in events]
    _analyse(ctx, res, measured, p)
    return res


def _analyse(ctx: SuiteContext, res: SuiteResult, measured: _Measured, p: LatencyPlan) -> None:
    results = measured.points
    res.tables.append(_latency_table(list(results.values())))
    res.tables.append(_service_table(list(results.values())))
    ramp = _ramp(results, p)
    found = knee(ramp, p.knee_gain)
    res.tables.append(_ramp_table(ramp, found))
    _plot_sweep(ctx, res, results, p)
    nmax = max(p.background)
    fair, turn = results[("fair", nmax)], results[("turn-based", nmax)]
    solo = results[("fair", p.background[0])]
    _headline(res, results, nmax, fair, turn, solo)
    res.headline["knee_concurrency"] = found.concurrency
    _checks(res, p, results, nmax, fair, turn, solo)
    res.info(
        f"throughput ramp knee (gain < {p.knee_gain:.0%} per doubling of concurrency while latency grows)",
        f"at {found.concurrency} coroutines: {found.detail}" if found.concurrency else found.detail,
    )
    if measured.stream:
        res.tables.append(_stream_table(measured.stream))
        _stream_checks(res, measured.stream)
    if measured.script:
        res.tables.append(_script_table(measured.script))
        failed = [e for e in measured.script if e.outcome != "ok"]
        res.check(
            "every scripted event finished without an error",
            not failed,
            f"{len(measured.script) - len(failed)}/{len(measured.script)} events"
            + (
                f"; first failure: event {failed[0].index} ({failed[0].op} {failed[0].coroutine}): "
                f"{failed[0].outcome}"
                if failed
                else ""
            ),
        )
    res.summary = (
        f"N={nmax} background: TTFT p50 {fair.ttft_p50:.2f} s (cothink) vs "
        f"{turn.ttft_p50:.2f} s (turn-based); end-to-end p50 {fair.e2e_p50:.2f} vs {turn.e2e_p50:.2f} s; "
        f"inter-token p99 {fair.itl_p99:.2f} (n={fair.itl_n}) vs {turn.itl_p99:.2f} s; throughput "
        f"{fair.throughput_tok_s:.1f} vs {turn.throughput_tok_s:.1f} tok/s; steps over the interactive cap "
        f"{fair.service.over_cap}/{fair.service.decode_steps}; knee "
        f"{found.concurrency if found.concurrency else 'not reached'}"
    )
    res.conditions += _conditions(p)


def _cell(value: float, n: int, q: float) -> str:
    """A percentile cell: the value, or why there is none."""
    return fmt(value) if n >= min_samples(q) else f"n<{min_samples(q)}"


def _latency_table(records: list[LatencyRow]) -> Table:
    return Table(
        "Foreground latency (seconds) and total throughput",
        [
            "mode",
            "N background",
            "requests done",
            "TTFT/e2e n",
            "TTFT p50",
            "TTFT p95",
            "TTFT p99",
            "e2e p50",
            "e2e p95",
            "e2e p99",
            "inter-token n",
            "inter-token p50",
            "inter-token p95",
            "inter-token p99",
            "throughput tok/s",
        ],
        [
            [
                rec.mode,
                rec.background,
                f"{rec.completed}/{rec.requests}",
                rec.ttft_n,
                *(_cell(getattr(rec, f"ttft_p{q}"), rec.ttft_n, q) for q in (50, 95, 99)),
                *(_cell(getattr(rec, f"e2e_p{q}"), rec.ttft_n, q) for q in (50, 95, 99)),
                rec.itl_n,
                *(_cell(getattr(rec, f"itl_p{q}"), rec.itl_n, q) for q in (50, 95, 99)),
                fmt(rec.throughput_tok_s),
            ]
            for rec in records
        ],
        note="n: samples behind each percentile (one per request for TTFT and end-to-end, one per gap "
        "between tokens for inter-token); 'n<K': fewer than the K samples the percentile needs (two "
        "samples beyond it), so it is not reported.",
    )


def _service_table(records: list[LatencyRow]) -> Table:
    return Table(
        "Order of service (from the engine's step timeline)",
        [
            "mode",
            "N background",
            "foreground decode steps",
            "shared with other work",
            "over the cap",
            "largest step (tokens)",
            "cap (interactive_step_tokens)",
            "steps per foreground prompt, max",
            "bound",
        ],
        [
            [
                r.mode,
                r.background,
                r.service.decode_steps,
                r.service.shared_steps,
                r.service.over_cap,
                r.service.max_step_tokens,
                r.service.cap,
                r.service.prompt_steps_max,
                r.service.prompt_bound,
            ]
            for r in records
            if r.mode != "turn-based"
        ],
        note="the cap and the bound are promises for an interactive foreground (mode fair); the one-class "
        "rows, where the foreground is background work, show what the same steps look like without them",
    )


def _ramp(results: Results, p: LatencyPlan) -> list[RampPoint]:
    """The throughput ramp: cothink fair at each N, concurrency N+1 (the foreground included)."""
    return [
        RampPoint(n + 1, results[("fair", n)].throughput_tok_s, results[("fair", n)].e2e_p50)
        for n in p.background
        if not math.isnan(results[("fair", n)].throughput_tok_s)
        and not math.isnan(results[("fair", n)].e2e_p50)
    ]


def _ramp_table(ramp: list[RampPoint], found: Knee) -> Table:
    gains = ["-", *(f"{g:+.1%}" for g in found.gains)]
    return Table(
        "Throughput ramp (cothink fair)",
        ["concurrency", "throughput tok/s", "gain per doubling", "foreground e2e p50 s", "knee"],
        [
            [
                pt.concurrency,
                fmt(pt.throughput),
                g,
                fmt(pt.latency),
                "<- knee" if pt.concurrency == found.concurrency else "",
            ]
            for pt, g in zip(ramp, gains)
        ],
        note=f"knee: the first concurrency after which throughput gains less than "
        f"{found.min_gain_per_doubling:.0%} per doubling of concurrency while the foreground's end-to-end "
        "p50 grows; " + found.detail,
    )


def _stream_table(rows: list[UtteranceRow]) -> Table:
    return Table(
        "Streamed input (pieces appended while a thinker generates)",
        [
            "utterance",
            "pieces",
            "tokens",
            "appends",
            "absorbed in order",
            "absorbing steps",
            "input tokens per step (mean / max)",
            "stream s",
            "last piece -> answer s",
            "thinker tokens meanwhile",
        ],
        [
            [
                r.utterance,
                r.pieces,
                r.piece_tokens,
                r.appends,
                fmt(r.absorbed_in_order),
                r.absorb_steps,
                f"{fmt(r.tokens_per_step_mean)} / {r.tokens_per_step_max}",
                fmt(r.stream_s),
                fmt(r.last_piece_to_answer_s),
                r.thinker_tokens_during,
            ]
            for r in rows
        ],
    )


def _script_table(events: list[EventResult]) -> Table:
    return Table(
        "Scripted workload (seconds)",
        ["event", "at", "op", "coroutine", "lag", "first token", "done", "tokens", "outcome", "answer"],
        [
            [
                e.index,
                fmt(e.at),
                e.op,
                e.coroutine,
                fmt(e.lag_s),
                fmt(e.first_s),
                fmt(e.done_s),
                e.tokens,
                e.outcome,
                e.answer[:40],
            ]
            for e in events
        ],
        note="lag: scheduled time -> submitted (the coroutine's previous event was still running); first "
        "token and done: from submission",
    )


def _plot_sweep(ctx: SuiteContext, res: SuiteResult, results: Results, p: LatencyPlan) -> None:
    """p50 latencies and throughput against N, one line per mode that ran."""
    series = {mode: [n for n in p.background if (mode, n) in results] for mode in MODES}
    ran = [mode for mode in series if series[mode]]

    lines(
        ctx.plot_path(NAME, "sweep"),
        f"{ctx.model.key}: foreground latency vs background coroutines",
        "background coroutines N",
        [
            (
                "TTFT p50 (s)",
                [(mode, series[mode], _p50s(results, mode, series[mode], "ttft")) for mode in ran],
            ),
            (
                "end-to-end p50 (s)",
                [(mode, series[mode], _p50s(results, mode, series[mode], "e2e")) for mode in ran],
            ),
            (
                "throughput (tok/s, all coroutines)",
                [
                    (mode, series[mode], [results[(mode, n)].throughput_tok_s for n in series[mode]])
                    for mode in ran
                ],
            ),
        ],
    )
    res.plots.append(ctx.plot_path(NAME, "sweep").name)


def _p50s(results: Results, mode: str, ns: list[int], key: str) -> list[float]:
    return [getattr(results[(mode, n)], f"{key}_p50") for n in ns]


def _headline(
    res: SuiteResult, results: Results, nmax: int, fair: LatencyRow, turn: LatencyRow, solo: LatencyRow
) -> None:
    res.headline.update(
        {
            "max_background": nmax,
            "fair_ttft_p50_at_max": fair.ttft_p50,
            "turn_ttft_p50_at_max": turn.ttft_p50,
            "fair_e2e_p50_at_max": fair.e2e_p50,
            "turn_e2e_p50_at_max": turn.e2e_p50,
            "fair_throughput_at_max": fair.throughput_tok_s,
            "turn_throughput_at_max": turn.throughput_tok_s,
            "fair_itl_p99_at_max": fair.itl_p99,
            "fair_itl_n_at_max": fair.itl_n,
            "solo_ttft_p50": solo.ttft_p50,
            "fair_steps_over_cap_at_max": fair.service.over_cap,
        }
    )
    if ("one-class", nmax) in results:
        res.headline["one_class_ttft_p50_at_max"] = results[("one-class", nmax)].ttft_p50
        res.headline["one_class_steps_over_cap_at_max"] = results[("one-class", nmax)].service.over_cap
    res.headline["solo_itl_p99"] = solo.itl_p99


def _compare(
    res: SuiteResult, name: str, samples: dict[str, tuple[float, int, float]], ok: Any, detail: str
) -> None:
    """A hard timing check over percentiles: FAIL with 'insufficient samples' when any percentile it
    compares has fewer samples than it needs (samples: label -> (value, n, q))."""
    short = [f"{k}: n={n} < {min_samples(q)}" for k, (_, n, q) in samples.items() if n < min_samples(q)]
    if short:
        res.check(name, False, "insufficient samples (" + "; ".join(short) + ")", timing=True)
    else:
        res.check(name, bool(ok()), detail, timing=True)


def _checks(
    res: SuiteResult,
    p: LatencyPlan,
    results: Results,
    nmax: int,
    fair: LatencyRow,
    turn: LatencyRow,
    solo: LatencyRow,
) -> None:
    rows = list(results.values())
    incomplete = [r for r in rows if r.completed < r.requests]
    res.check(
        "every foreground request completed with all its tokens (no starvation, no deadlock)",
        not incomplete,
        f"{sum(r.completed for r in rows)}/{sum(r.requests for r in rows)} requests in {len(rows)} "
        "configurations"
        + "".join(
            f"; {r.mode} N={r.background}: {r.completed}/{r.requests} ({r.errors[:1]})" for r in incomplete
        ),
    )
    bg_failed = [r for r in rows if r.bg_errors]
    res.check(
        "no background job failed",
        not bg_failed,
        "; ".join(f"{r.mode} N={r.background}: {r.bg_errors} ({r.errors[-1:]})" for r in bg_failed),
    )
    contested = [results[("fair", n)] for n in p.background if n > 0]
    res.check(
        "while the interactive foreground decodes, every step carries at most interactive_step_tokens "
        "tokens in all, background work included (priority order of service)",
        bool(contested) and all(r.service.over_cap == 0 and r.service.shared_steps > 0 for r in contested),
        "; ".join(
            f"N={r.background}: {r.service.over_cap} of {r.service.decode_steps} decode steps over "
            f"the cap of {r.service.cap} (largest {r.service.max_step_tokens} tokens), "
            f"{r.service.shared_steps} shared with background work"
            for r in contested
        )
        or "no point with background coroutines: the property was not exercised",
    )
    res.check(
        "every interactive foreground prompt is served within the policy's bound on steps, however much "
        "background work is queued",
        bool(contested) and all(r.service.prompt_steps_max <= r.service.prompt_bound for r in contested),
        "; ".join(
            f"N={r.background}: at most {r.service.prompt_steps_max} steps (bound {r.service.prompt_bound})"
            for r in contested
        ),
    )
    one_class = [results[("one-class", n)] for n in p.background if ("one-class", n) in results]
    if one_class:
        res.info(
            "control: the same workload with the foreground as background work (one priority class)",
            "; ".join(
                f"N={r.background}: {r.service.over_cap} of {r.service.decode_steps} foreground decode steps "
                f"over the cap (largest {r.service.max_step_tokens} tokens)"
                for r in one_class
            ),
        )
    _compare(
        res,
        f"with N={nmax} background, cothink's foreground TTFT p50 beats turn-based",
        {"cothink": (fair.ttft_p50, fair.ttft_n, 50), "turn-based": (turn.ttft_p50, turn.ttft_n, 50)},
        lambda: fair.ttft_p50 < turn.ttft_p50,
        f"{fair.ttft_p50:.3f}s (n={fair.ttft_n}) vs {turn.ttft_p50:.3f}s (n={turn.ttft_n})",
    )
    res.check(
        f"with N={nmax} background, concurrent throughput beats turn-based",
        fair.throughput_tok_s > turn.throughput_tok_s,
        f"{fair.throughput_tok_s:.1f} vs {turn.throughput_tok_s:.1f} tok/s",
        timing=True,
    )
    _compare(
        res,
        f"with N={nmax} background, the interactive foreground's inter-token p99 stays within 2x of "
        "its p99 alone",
        {"with background": (fair.itl_p99, fair.itl_n, 99), "alone": (solo.itl_p99, solo.itl_n, 99)},
        lambda: fair.itl_p99 <= 2 * solo.itl_p99,
        f"{fair.itl_p99:.3f}s (n={fair.itl_n}) vs {solo.itl_p99:.3f}s alone (n={solo.itl_n}): while it "
        "decodes, background work fills a step only up to interactive_step_tokens",
    )
    if fair.ttft_n >= min_samples(50) and turn.ttft_n >= min_samples(50):
        res.check(
            f"with N={nmax} background, cothink's foreground end-to-end p50 is not worse than turn-based",
            fair.e2e_p50 <= turn.e2e_p50,
            f"{fair.e2e_p50:.3f}s vs {turn.e2e_p50:.3f}s (n={fair.ttft_n}, {turn.ttft_n}): the foreground's "
            f"steps also carry the {nmax} background coroutines' decode tokens (up to "
            "interactive_step_tokens in all)",
            soft=True,
            timing=True,
        )


def _stream_checks(res: SuiteResult, rows: list[UtteranceRow]) -> None:
    failed = [r for r in rows if r.error]
    res.check(
        "streamed input: every utterance was absorbed and answered (no deadlock, no error)",
        not failed,
        f"{len(rows) - len(failed)}/{len(rows)} utterances" + (f"; {failed[0].error}" if failed else ""),
    )
    res.check(
        "streamed input: the block holds exactly every piece's tokens, in arrival order",
        all(r.absorbed_in_order for r in rows),
        f"{sum(r.absorbed_in_order for r in rows)}/{len(rows)} utterances",
    )
    res.check(
        "streamed input: the thinker kept generating while the pieces were absorbed",
        all(r.thinker_tokens_during > 0 for r in rows),
        f"thinker tokens during each utterance: {[r.thinker_tokens_during for r in rows]}",
    )
    reaction = sampled_percentile([r.last_piece_to_answer_s for r in rows if not r.error], 50)
    per_step = [r.tokens_per_step_mean for r in rows if r.absorb_steps]
    res.info(
        "streamed input: last piece -> first answer token, p50",
        f"{reaction}; input tokens absorbed per step (mean over utterances) "
        f"{fmt(sum(per_step) / len(per_step)) if per_step else '-'}; appends per utterance "
        f"{[r.appends for r in rows]} for {[r.pieces for r in rows]} pieces",
    )
    res.headline["stream_last_piece_to_answer_p50"] = reaction.value
    res.headline["stream_last_piece_to_answer_n"] = reaction.n


def _conditions(p: LatencyPlan) -> list[str]:
    out = [
        f"N background in {list(p.background)}; foreground: {p.requests} requests of {p.fg_tokens} "
        f"tokens after a chat prompt ({p.requests * (p.fg_tokens - 1)} inter-token gaps per point); "
        f"background jobs: {p.bg_prompt}-token prompt + {p.bg_tokens} tokens, greedy",
        "CPU, forward passes in the engine's worker thread; default scheduler limits (256 tokens, 64 items "
        "per step, prefill chunks of 128, 16 tokens per step reserved for background work, steps capped at "
        "4 tokens while the interactive foreground decodes)",
        "turn-based baseline = the kindest turn-based server (foreground first at request boundaries); a "
        "FIFO server would make the foreground wait for the whole background backlog",
        "order-of-service checks count steps and tokens in the engine's timeline: they hold or fail the same "
        "on any machine; checks marked (timing) compare measured times and move with the machine's load",
    ]
    if p.stream is not None:
        s = p.stream
        out.append(
            f"streamed input: {s.utterances} utterances of {s.words} words, half-words every "
            f"{s.piece_s * 1000:.0f} ms, answer of {s.answer_tokens} tokens; a background thinker generates "
            f"throughout (jobs of {s.thinker_tokens} tokens)"
        )
    if p.script is not None:
        out.append(f"scripted workload: {p.script}")
    return out
