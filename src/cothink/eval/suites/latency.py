"""Suite 2: foreground latency and jitter while background coroutines run, against turn-based serving.

A foreground user sends short requests one after another (closed loop); N background coroutines keep
generating (each: read a prompt, generate, start over). cothink runs them all concurrently in one
engine, with the fairness policy (foreground 'interactive') and without it (foreground 'background',
i.e. one priority class for all). The turn-based baseline runs the same clients against a server that
serves one request at a time (foreground requests jump the queue at request boundaries: the kindest
turn-based policy).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cothink.eval.common import SuiteContext, SuiteResult, Table, fmt, percentile, plan_params, within
from cothink.eval.plots import lines
from cothink.eval.workload import filler_words

NAME = "latency"
TITLE = "Streaming latency and jitter under concurrency"
QUESTION = (
    "Is first-response and end-to-end latency of a foreground coroutine under control while background "
    "coroutines run, how much does it jitter, and what does concurrency cost or buy against turn-based "
    "serving (one request after another) on the same weights?"
)
METHOD = (
    "Foreground: R requests in a closed loop (chat prompt, greedy, fixed number of new tokens). Background: "
    "N coroutines, each looping over jobs (prompt of P tokens, generate G tokens). Modes: **cothink fair** "
    "(foreground priority 'interactive'), **cothink one class** (foreground priority 'background', the "
    "policy's class separation off), **turn-based** (one request at a time; foreground requests are served "
    "next when the current request ends). TTFT = request submitted -> first new token; end-to-end = "
    "submitted -> last token; jitter = inter-token intervals of the foreground stream. Throughput = all "
    "tokens generated (foreground + background) per second during the foreground's window."
)

TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class LatencyPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    background: tuple[int, ...]  # N: background jobs at each point of the sweep
    requests: int  # foreground requests per point
    fg_tokens: int
    bg_prompt: int
    bg_tokens: int
    gap_s: float


def plan(quick: bool, duration: float | None = None) -> LatencyPlan:
    if quick:
        return LatencyPlan(
            background=(0, 2, 8), requests=3, fg_tokens=8, bg_prompt=48, bg_tokens=16, gap_s=0.05
        )
    return LatencyPlan(
        background=(0, 1, 2, 4, 8, 16, 32), requests=8, fg_tokens=16, bg_prompt=96, bg_tokens=32, gap_s=0.1
    )


def _estimate_raw(p: LatencyPlan, speed) -> float:
    total = 0.0
    per_req = 20 / speed.prefill_tps + p.fg_tokens * speed.step_s
    bg_job = p.bg_prompt / speed.prefill_tps + p.bg_tokens * speed.step_s
    for n in p.background:
        conc = p.requests * (p.fg_tokens + 2) * speed.step_s * (1 + 0.35 * n)
        total += conc * (2 if n else 1)
        total += p.requests * (per_req + (bg_job if n else 0)) + (bg_job if n else 0)
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
            await self.serve(1, prompt, self.p.bg_tokens, f"bg{i}", "background")

    async def wait_for_background(self) -> None:
        """Let the background get going: a token from each client, or two minutes."""
        if self.n_bg:
            t0 = time.perf_counter()
            while len(self.token_times) < self.n_bg and time.perf_counter() - t0 < 120:
                await asyncio.sleep(0.01)

    async def foreground(self) -> None:
        """The closed loop: a request, its whole answer, a short gap, the next request."""
        p = self.p
        for r in range(p.requests):
            submitted = time.perf_counter()
            times = await within(
                self.serve(0, self.fg_prompts[r], p.fg_tokens, "fg", self.fg_priority), TIMEOUT, "fg"
            )
            self.requests.append(_ForegroundRequest(submitted, times))
            await asyncio.sleep(p.gap_s)

    async def run(self) -> tuple[float, float]:
        """Run the point in the (started) engine; returns the foreground's window (start, end)."""
        server_task = asyncio.create_task(self.server.serve()) if self.server else None
        bg_tasks = [asyncio.create_task(self.background_client(i)) for i in range(self.n_bg)]
        await self.wait_for_background()
        window_start = time.perf_counter()
        await self.foreground()
        window_end = self.requests[-1].times[-1]
        self.stop.set()
        await within(asyncio.gather(*bg_tasks), TIMEOUT, "background clients")
        if server_task:
            server_task.cancel()
            await asyncio.gather(server_task, return_exceptions=True)
        return window_start, window_end


@dataclass(frozen=True, slots=True)
class LatencyRow:
    """One point of the sweep: a row of raw/latency-<model>.csv (latencies in seconds)."""

    mode: str  # "fair", "one-class" or "turn-based"
    background: int  # N: background coroutines
    throughput_tok_s: float  # all tokens generated per second of the foreground's window
    fg_tok_s: float  # foreground tokens per second of foreground end-to-end time
    window_s: float  # the foreground's window: first request -> last token
    ttft_p50: float  # time to first token, percentiles over the foreground requests
    ttft_p95: float
    ttft_p99: float
    e2e_p50: float  # submitted -> last token
    e2e_p95: float
    e2e_p99: float
    itl_p50: float  # inter-token intervals of the foreground streams
    itl_p95: float
    itl_p99: float
    ttft_all: list[float]  # every foreground request's TTFT
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
        fg_prompts=[
            m.chat(f"Reply in a few words: what is {i + 2} plus {i + 3}?") for i in range(p.requests)
        ],
    )
    async with engine:
        point.server = TurnServer() if mode == "turn-based" else None
        window_start, window_end = await point.run()
    requests = point.requests
    ttft = [r.times[0] - r.submitted for r in requests]
    e2e = [r.times[-1] - r.submitted for r in requests]
    itl = [b - a for r in requests for a, b in zip(r.times, r.times[1:])]
    in_window = sum(1 for t in point.token_times if window_start <= t <= window_end)
    window = window_end - window_start
    return LatencyRow(
        mode=mode,
        background=n_bg,
        throughput_tok_s=in_window / window if window > 0 else float("nan"),
        fg_tok_s=p.requests * p.fg_tokens / sum(e2e),
        window_s=window,
        ttft_p50=percentile(ttft, 50),
        ttft_p95=percentile(ttft, 95),
        ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p95=percentile(e2e, 95),
        e2e_p99=percentile(e2e, 99),
        itl_p50=percentile(itl, 50),
        itl_p95=percentile(itl, 95),
        itl_p99=percentile(itl, 99),
        ttft_all=ttft,
        e2e_all=e2e,
    )


async def run(ctx: SuiteContext, p: LatencyPlan) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=plan_params(p))
    results: Results = {}
    for n_bg in p.background:
        for mode in MODES:
            if mode == "one-class" and n_bg == 0:
                continue  # nothing to compete with: identical to 'fair'
            ctx.say(f"{mode}, {n_bg} background")
            results[(mode, n_bg)] = await _measure(ctx, p, n_bg, mode)
    res.records = [asdict(r) for r in results.values()]
    _analyse(ctx, res, results, p)
    return res


MODES = ("fair", "one-class", "turn-based")


def _analyse(ctx: SuiteContext, res: SuiteResult, results: Results, p: LatencyPlan) -> None:
    res.tables.append(_latency_table(list(results.values()), p))
    _plot_sweep(ctx, res, results, p)
    nmax = max(p.background)
    fair, turn = results[("fair", nmax)], results[("turn-based", nmax)]
    solo = results[("fair", p.background[0])]
    _headline(res, results, nmax, fair, turn, solo)
    _checks(res, p, nmax, fair, turn, solo)
    res.summary = (
        f"N={nmax} background: TTFT p50 {fair.ttft_p50:.2f} s (cothink) vs "
        f"{turn.ttft_p50:.2f} s (turn-based); end-to-end p50 "
        f"{fair.e2e_p50:.2f} vs "
        f"{turn.e2e_p50:.2f} s; inter-token p99 {fair.itl_p99:.2f} vs "
        f"{turn.itl_p99:.2f} s; throughput {fair.throughput_tok_s:.1f} vs "
        f"{turn.throughput_tok_s:.1f} tok/s"
    )
    res.conditions += _conditions(p)


_LATENCY_COLUMNS = (
    "ttft_p50",
    "ttft_p95",
    "ttft_p99",
    "e2e_p50",
    "e2e_p95",
    "e2e_p99",
    "itl_p50",
    "itl_p95",
    "itl_p99",
    "throughput_tok_s",
)


def _latency_table(records: list[LatencyRow], p: LatencyPlan) -> Table:
    return Table(
        "Foreground latency (seconds) and total throughput",
        [
            "mode",
            "N background",
            "TTFT p50",
            "TTFT p95",
            "TTFT p99",
            "e2e p50",
            "e2e p95",
            "e2e p99",
            "inter-token p50",
            "inter-token p95",
            "inter-token p99",
            "throughput tok/s",
        ],
        [[rec.mode, rec.background, *(fmt(getattr(rec, k)) for k in _LATENCY_COLUMNS)] for rec in records],
        note=f"{p.requests} foreground requests per point ({p.fg_tokens} tokens each): with so "
        "few samples "
        "p95/p99 are close to the maximum.",
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
            "solo_ttft_p50": solo.ttft_p50,
        }
    )
    if ("one-class", nmax) in results:
        res.headline["one_class_ttft_p50_at_max"] = results[("one-class", nmax)].ttft_p50
    res.headline["solo_itl_p99"] = solo.itl_p99


def _checks(
    res: SuiteResult, p: LatencyPlan, nmax: int, fair: LatencyRow, turn: LatencyRow, solo: LatencyRow
) -> None:
    res.check(
        "every foreground request completed (no starvation, no deadlock)",
        True,
        f"{len(res.records)} configurations x {p.requests} requests",
    )
    res.check(
        f"with N={nmax} background, cothink's foreground TTFT p50 beats turn-based",
        fair.ttft_p50 < turn.ttft_p50,
        f"{fair.ttft_p50:.3f}s vs {turn.ttft_p50:.3f}s",
        soft=True,
    )
    res.check(
        f"with N={nmax} background, concurrent throughput beats turn-based",
        fair.throughput_tok_s > turn.throughput_tok_s,
        f"{fair.throughput_tok_s:.1f} vs {turn.throughput_tok_s:.1f} tok/s",
        soft=True,
    )
    res.check(
        f"with N={nmax} background, cothink's foreground end-to-end p50 is not worse than turn-based",
        fair.e2e_p50 <= turn.e2e_p50,
        f"{fair.e2e_p50:.3f}s vs {turn.e2e_p50:.3f}s: the foreground's "
        f"steps also carry the {nmax} background coroutines' decode tokens (up to "
        "interactive_step_tokens in all)",
        soft=True,
    )
    solo_itl = solo.itl_p99
    res.check(
        f"with N={nmax} background, the interactive foreground's inter-token p99 stays within 2x of "
        "its p99 alone",
        fair.itl_p99 <= 2 * solo_itl,
        f"{fair.itl_p99:.3f}s vs {solo_itl:.3f}s alone: while it decodes, background "
        "work fills a step only up to interactive_step_tokens",
        soft=True,
    )


def _conditions(p: LatencyPlan) -> list[str]:
    return [
        f"N background in {list(p.background)}; foreground: {p.requests} requests of {p.fg_tokens} "
        f"tokens after a chat prompt; background jobs: {p.bg_prompt}-token prompt + {p.bg_tokens} "
        "tokens, greedy",
        "CPU, forward passes in the engine's worker thread; default scheduler limits (256 tokens, 64 items "
        "per step, prefill chunks of 128, 16 tokens per step reserved for background work, steps capped at "
        "4 tokens while the interactive foreground decodes)",
        "turn-based baseline = the kindest turn-based server (foreground first at request boundaries); a "
        "FIFO "
        "server would make the foreground wait for the whole background backlog",
        "all decodes fit in one step here (N+1 <= 64 items, <= 256 tokens), so the fairness policy only "
        "decides "
        "prefill order; it matters more when steps are saturated by prefill",
    ]
