"""How many torch threads a step uses, and how idle OpenMP threads wait.

Measured on a 2-core CPU (docs/benchmarks.md): on a quiet machine a step is faster on both cores
(decode streams the weights with more bandwidth, wide steps have more compute), but when another
process keeps a core busy every parallel region waits for the thread on that core (decode fell from
15.8 to 5.5 tok/s, a 32-row step took 5-10x longer). No fixed rule is right for both, so
`ThreadChooser` measures: per width bucket it keeps the time per row of one thread and of all,
uses the faster, and re-tries the other now and then so it notices when contention comes or goes.
Each width is tried on one thread once, after a few warm-up steps: a process started beside busy
cores has no quiet figure to be slower than, and on two shared cores a step on both threads can take
several times its one-thread time.
Later contention is suspected only after two slow steps in a row: one slow step is usually noise (a
collector pause, a page fault), and a one-thread trial costs a small step about twice its time, so
trials on single spikes put every twentieth token of an interactive stream at twice the median gap.

Idle OpenMP threads spin by default (libgomp: about 300k iterations, ~10 ms here), burning the core
the engine's own event loop, agents and server need; sleeping at once (`OMP_WAIT_POLICY=PASSIVE`)
costs a futex wake-up at every one of the ~300 parallel regions of a step instead. `import cothink`
sets `GOMP_SPINCOUNT` (`SPIN_COUNT` below) unless the user set a policy: a thread spins through the
short gaps between a step's ops and sleeps within about a millisecond after the step. libgomp reads
it when torch is loaded, so a process that imported torch first keeps its policy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cothink.ops import native

T = TypeVar("T")
SPIN_COUNT = "30000"  # GOMP_SPINCOUNT set by `import cothink` (cothink/__init__.py mirrors it)


# A re-try while the core is still taken costs ~5-10 steps' time (every parallel region waits on it);
# when the core is free again, all threads gain ~30% per step. Re-trying more often than every ~30
# steps costs more under lasting contention than it wins back when it ends (measured: 32 coroutines,
# one core busy, 0.41-0.47 of quiet with re-tries from 8 steps on).
FIRST_RETRY = 32


@dataclass
class _Bucket:
    """What was measured for steps of similar width: seconds per row of each thread count, and
    which count won the last comparison of the two."""

    per_row: dict[int, float] = field(default_factory=dict)  # moving average per thread count
    one: bool = False  # one thread won the last comparison (a trial of one, or a re-try of all)
    steps: int = 0  # all-threads steps measured (the first WARM_STEPS are warm-up)
    slow_run: int = 0  # consecutive all-threads steps much slower per row than their average
    since_retry: int = 0  # steps on one thread since all threads were last re-tried
    retry_after: int = FIRST_RETRY  # doubles while re-tries confirm one thread, resets when one flips it


class ThreadChooser:
    """Threads per step: all (`max_threads`) unless measured slower than one, per width bucket
    (steps of 1 row, 2-3, 4-7, 8-15, ...). The choice changes only when the other count is measured
    beside a fresh figure of the current one, never because two averages of different ages crossed
    (a growing context slows every step; an old one-thread figure would look faster). One thread is
    tried once per bucket after `WARM_STEPS` all-threads steps (compared with the last of those,
    not an average still holding the first step's one-off costs), and again when two all-threads
    steps in a row run much slower per row than their average (another process took a core); while
    one thread wins, all threads are re-tried after 32, 64, ... 256 steps so the engine goes back to
    them when the other process is gone. A quiet machine pays one trial step per width."""

    SUSPECT_RATIO = 1.5
    SUSPECT_STEPS = 2  # slow all-threads steps in a row before one thread is tried
    WARM_STEPS = 3  # all-threads steps of a width before its one-thread trial
    MAX_RETRY_AFTER = 256

    def __init__(self, max_threads: int, alpha: float = 0.3):
        self.max_threads = max(1, max_threads)
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, rows: int) -> int:
        if self.max_threads == 1:
            return 1
        b = self._bucket(rows)
        if b.one:
            return self.max_threads if b.since_retry >= b.retry_after else 1
        if self._suspect(b) or self._untried(b):
            return 1  # measure one thread now
        return self.max_threads

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """Record a step of `rows` rows that took `seconds` on `threads` threads."""
        b = self._bucket(rows)
        sample, old = seconds / rows, b.per_row.get(threads)
        if self.max_threads == 1:  # nothing to choose: the figure only (`expected_seconds`)
            b.per_row[1] = sample if old is None else old + self.alpha * (sample - old)
            return
        if threads == 1:
            trial = not b.one  # tried beside all threads' figure: measured afresh, and it decides
            b.slow_run = 0
            b.since_retry += 1
            b.per_row[1] = sample if old is None or trial else old + self.alpha * (sample - old)
            if trial:
                b.one = sample < b.per_row.get(self.max_threads, float("inf"))
            return
        retry = b.one
        slow = old is not None and sample > self.SUSPECT_RATIO * old
        b.slow_run = b.slow_run + 1 if slow else 0
        b.steps += 1
        if slow and not retry and not self._suspect(b):
            return  # a lone slow step is held out of the average: noise until the next confirms it
        # measured afresh: a re-try or a confirmed slowdown (the old figure is from before contention
        # changed), and each warm-up step
        fresh = old is None or retry or slow or b.steps <= self.WARM_STEPS
        b.per_row[threads] = sample if fresh else old + self.alpha * (sample - old)
        if retry:
            b.one = b.per_row[1] < sample
            b.retry_after = min(self.MAX_RETRY_AFTER, 2 * b.retry_after) if b.one else FIRST_RETRY
            b.since_retry = 0

    def expected_seconds(self, rows: int) -> float | None:
        """What a step of `rows` rows takes on the thread count `choose` gives now, from its width's
        figure; None before one was measured."""
        b = self._buckets.get(rows.bit_length())
        if b is None:
            return None
        per_row = b.per_row.get(1 if b.one or self.max_threads == 1 else self.max_threads)
        return None if per_row is None else per_row * rows

    def _suspect(self, b: _Bucket) -> bool:
        """Enough slow all-threads steps in a row: measure one thread next."""
        return b.slow_run >= self.SUSPECT_STEPS

    def _untried(self, b: _Bucket) -> bool:
        """Warmed up on all threads and never measured on one: the bucket's one trial is due."""
        return b.steps >= self.WARM_STEPS and 1 not in b.per_row

    def _bucket(self, rows: int) -> _Bucket:
        return self._buckets.setdefault(rows.bit_length(), _Bucket())


_compute: ThreadPoolExecutor | None = None
_compute_lock = threading.Lock()


def compute_executor() -> ThreadPoolExecutor:
    """The one thread that runs cothink's parallel torch work in this process: model loading and
    every engine's forward passes. libgomp gives each thread that runs parallel regions its own
    pool of OpenMP threads and counts them all; once more are counted than there are cores (a pool
    for the loading thread and one for a forward-pass thread already make 3 on a 2-core machine),
    every waiting OpenMP thread stops spinning and sleeps between ops, which cost a 32-coroutine step
    ~25%. One compute thread keeps one pool. Code that wants to run its own multi-threaded torch work
    next to an engine without that cost can submit it here too (the benchmarks do, for transformers)."""
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ThreadPoolExecutor(1, thread_name_prefix="cothink-compute")
        return _compute


def run_compute(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the compute thread with the caller's torch thread count, waiting for
    it (directly if already there)."""
    if threading.current_thread().name.startswith("cothink-compute"):
        return fn(*args, **kwargs)
    threads = torch.get_num_threads()

    def call() -> T:
        use_threads(threads)
        return fn(*args, **kwargs)

    return compute_executor().submit(call).result()


@contextmanager
def threads_for(n: int) -> Iterator[None]:
    """Run a block with this thread's torch thread count set to n, then restore it. The scheduler
    does its small per-step torch work on the event-loop thread this way (one thread): a second
    OpenMP team next to the worker's made libgomp count more busy threads than cores and stop
    spinning (see compute_executor)."""
    before = torch.get_num_threads()
    use_threads(n)
    try:
        yield
    finally:
        use_threads(before)


@contextmanager
def loop_step_threads(n: int) -> Iterator[None]:
    """Run a step's forward pass on the event-loop thread (the scheduler does for short steps of the
    fused C decode path): its torch ops on one thread, as `threads_for(1)`, and cothink's C kernels,
    which run such a step on helper threads of their own, on n (`native.team_threads`)."""
    with threads_for(1), native.team_threads(n):
        yield


def use_threads(n: int) -> None:
    """Set this thread's torch thread count (OpenMP's is per calling thread) when it differs."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
