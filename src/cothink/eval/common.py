"""Shared pieces of the evaluation suites: results, statistics, fits, leak detection, timeouts."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

PASS, FAIL, WARN, INFO = "PASS", "FAIL", "WARN", "INFO"


@dataclass
class Check:
    """One verdict of a suite: PASS / FAIL (a red line), WARN (a finding that is not a red line), INFO.

    A hard check (PASS / FAIL) is either a property (token counts, the order of service, every request
    answered: the same on any machine) or, with `timing`, a comparison of measured times, which a
    loaded machine can move."""

    name: str
    status: str
    detail: str = ""
    timing: bool = False


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""


@dataclass
class SuiteResult:
    """What one suite found on one model."""

    suite: str
    model: str
    params: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)  # key numbers, for the summary and JSON
    conditions: list[str] = field(default_factory=list)  # under which conditions the answer holds
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # file names in the results folder
    records: list[dict[str, Any]] = field(default_factory=list)  # raw measurements (one dict per row)
    summary: str = ""  # one line for the report's summary
    elapsed_s: float = 0.0
    error: str | None = None  # the suite crashed: the traceback's last line

    def check(
        self, name: str, ok: bool, detail: str = "", *, soft: bool = False, timing: bool = False
    ) -> bool:
        self.checks.append(Check(name, PASS if ok else (WARN if soft else FAIL), detail, timing))
        return ok

    def info(self, name: str, detail: str = "") -> None:
        """A finding recorded with the checks that is no verdict (it never changes the status)."""
        self.checks.append(Check(name, INFO, detail))

    @property
    def status(self) -> str:
        if self.error is not None or any(c.status == FAIL for c in self.checks):
            return FAIL
        if any(c.status == WARN for c in self.checks):
            return WARN
        return PASS


def plan_params(plan: Any) -> dict[str, Any]:
    """A suite's plan (a frozen dataclass of its knobs) as the dict `SuiteResult.params` records."""
    return dataclasses.asdict(plan)


@dataclass
class SuiteContext:
    """What a suite gets: the model, the mode, where to write plots, a progress callback."""

    model: Any  # models.ModelHandle
    quick: bool
    out: Path
    duration_s: float | None = None  # soak duration
    progress: Callable[[str], None] = lambda message: None
    seed: int = 0

    def say(self, message: str) -> None:
        self.progress(message)

    def plot_path(self, suite: str, name: str) -> Path:
        return self.out / f"{suite}-{self.model.key}-{name}.png"


# ---- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def min_samples(q: float) -> int:
    """Samples a q-th percentile needs to mean what it says: at least two samples lie beyond it
    (4 for p50, 40 for p95, 200 for p99). Fewer, and the "p99" is just the maximum."""
    if not 0 <= q < 100:
        raise ValueError(f"percentile must be in [0, 100), got {q}")
    return math.ceil(round(2 / (1 - q / 100), 9))


@dataclass(frozen=True, slots=True)
class Sampled:
    """A percentile with the number of samples it was computed from; `value` is NaN when there were
    fewer than `min_samples(q)`: such a percentile is reported as insufficient, never compared."""

    q: float
    value: float
    n: int

    @property
    def enough(self) -> bool:
        return self.n >= min_samples(self.q)

    def __str__(self) -> str:
        if not self.enough:
            return f"insufficient (n={self.n} < {min_samples(self.q)})"
        return f"{fmt(self.value)} (n={self.n})"


def sampled_percentile(values: Sequence[float], q: float) -> Sampled:
    n = len(values)
    return Sampled(q, percentile(values, q) if n >= min_samples(q) else math.nan, n)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class LinearFit:
    slope: float
    intercept: float
    r2: float
    n: int

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least-squares line y = intercept + slope * x."""
    n = len(xs)
    if n != len(ys):
        raise ValueError("xs and ys differ in length")
    if n == 0:
        return LinearFit(math.nan, math.nan, math.nan, 0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        return LinearFit(0.0, my, math.nan, n)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LinearFit(slope, intercept, r2, n)


@dataclass(frozen=True)
class Trend:
    """A leak verdict for one sampled series: growth over the second half of the run."""

    name: str
    slope_per_s: float
    growth: float  # slope * (second-half duration)
    allowed: float
    first: float
    last: float
    leaking: bool


def detect_growth(
    name: str, times: Sequence[float], values: Sequence[float], *, abs_tol: float, rel_tol: float = 0.0
) -> Trend:
    """Fit a line over the second half of (times, values); leaking if the fitted growth over that half
    exceeds max(abs_tol, rel_tol * mean of the half). A bounded series (flat, saw-tooth, or a plateau
    reached in the first half) passes; steady growth fails."""
    if len(times) != len(values):
        raise ValueError("times and values differ in length")
    if len(times) < 4:
        return Trend(name, math.nan, math.nan, abs_tol, math.nan, math.nan, False)
    t_mid = times[0] + (times[-1] - times[0]) / 2
    half = [(t, v) for t, v in zip(times, values) if t >= t_mid]
    if len(half) < 3:
        half = list(zip(times, values))[-3:]
    ts, vs = [t for t, _ in half], [v for _, v in half]
    fit = linear_fit(ts, vs)
    span = ts[-1] - ts[0]
    growth = fit.slope * span
    allowed = max(abs_tol, rel_tol * abs(mean(vs)))
    return Trend(name, fit.slope, growth, allowed, float(values[0]), float(values[-1]), growth > allowed)


@dataclass(frozen=True, slots=True)
class RampPoint:
    """One point of a throughput ramp: all tokens per second and a request latency at a concurrency."""

    concurrency: int  # coroutines running at once (>= 1)
    throughput: float  # tokens per second, all coroutines
    latency: float  # seconds (a foreground request's end-to-end p50)


@dataclass(frozen=True, slots=True)
class Knee:
    """Where a throughput ramp stops paying: `concurrency` is the last point worth going to, None when
    the gains never fell below the threshold within the measured range (the knee lies beyond it)."""

    concurrency: int | None
    min_gain_per_doubling: float
    gains: tuple[float, ...]  # per segment i -> i+1: throughput gain per doubling of concurrency
    detail: str


def knee(points: Sequence[RampPoint], min_gain_per_doubling: float = 0.10) -> Knee:
    """The knee of a throughput ramp: the first point after which throughput gains less than
    `min_gain_per_doubling` (relative, per doubling of concurrency) while latency grows.

    A segment from concurrency a to b (b > a) gains g = (T_b / T_a) ** (1 / log2(b / a)) - 1 per doubling,
    so points spaced 1, 3, 9 and 1, 2, 4, 8 are judged alike. A segment whose throughput gain is small
    but whose latency does not grow is free concurrency, not a knee."""
    pts = sorted(points, key=lambda p: p.concurrency)
    if len({p.concurrency for p in pts}) != len(pts):
        raise ValueError("ramp points must have distinct concurrencies")
    if any(p.concurrency < 1 for p in pts):
        raise ValueError("concurrency must be >= 1")
    gains = []
    for a, b in zip(pts, pts[1:]):
        if a.throughput <= 0:
            gains.append(math.inf if b.throughput > 0 else 0.0)
            continue
        doublings = math.log2(b.concurrency / a.concurrency)
        gains.append((b.throughput / a.throughput) ** (1 / doublings) - 1)
    for i, g in enumerate(gains):
        a, b = pts[i], pts[i + 1]
        if g < min_gain_per_doubling and b.latency > a.latency:
            return Knee(
                a.concurrency,
                min_gain_per_doubling,
                tuple(gains),
                f"from {a.concurrency} to {b.concurrency} coroutines throughput gained {g:+.1%} per "
                f"doubling (< {min_gain_per_doubling:.0%}) while latency grew {a.latency:.3g} -> "
                f"{b.latency:.3g} s",
            )
    last = pts[-1].concurrency if pts else None
    return Knee(
        None,
        min_gain_per_doubling,
        tuple(gains),
        f"not reached up to {last} coroutines: every step gained >= {min_gain_per_doubling:.0%} "
        "throughput per doubling, or latency did not grow",
    )


# ---- async helpers ---------------------------------------------------------------------------


class Deadlock(Exception):
    """An awaited operation did not finish within its timeout."""


async def within(awaitable: Awaitable[T], timeout: float, what: str) -> T:
    """Await in the current task (unlike wait_for on 3.11, which wraps a coroutine in a new task and so
    lets the engine run a step before the operation is even submitted); Deadlock on timeout."""
    try:
        async with asyncio.timeout(timeout):
            return await awaitable
    except TimeoutError:
        raise Deadlock(f"{what} did not finish within {timeout:.0f}s") from None


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def fmt(x: Any, digits: int = 3) -> str:
    """Compact number formatting for tables."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 100:
            return f"{x:.1f}"
        if abs(x) >= 1:
            return f"{x:.{digits - 1}f}" if digits > 1 else f"{x:.0f}"
        if abs(x) >= 1e-3:
            return f"{x:.4f}"
        return f"{x:.2e}"
    return str(x)


def engine_idle_state(engine: Any) -> dict[str, int]:
    """What the engine holds: live blocks, used/free pages, running works, writer entries."""
    mem = engine.memory()
    return {
        "live_blocks": mem.live_blocks,
        "used_pages": mem.used_pages,
        "free_pages": mem.free_pages,
        "works": engine.occupancy().works,
        "writers": engine.occupancy().writers,
        "holds": engine.occupancy().held_blocks,
    }


def numbers_in(text: str) -> list[int]:
    """Integers written in text (with an optional leading minus sign)."""
    import re

    return [int(m) for m in re.findall(r"-?\d+", text.replace(",", ""))]
