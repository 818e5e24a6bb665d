"""How many torch threads a step uses, and how idle OpenMP threads wait.

Measured on a 2-core CPU (docs/benchmarks.md): a decode step of one or a few rows is bound by
streaming the weights, and a second OpenMP thread adds nothing to it. Wide steps (prefill chunks,
many decoding coroutines) are compute-bound and gain from every thread, unless another process
keeps a core busy: then every parallel region waits for the thread on the busy core (decode fell
from 15.8 to 5.5 tok/s, a 32-row step took 5-10x longer). No fixed rule is right for both, so
`ThreadChooser` measures: per width bucket it keeps the time per row of one thread and of all,
uses the faster, and re-tries the other now and then so it notices when contention comes or goes.

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

# steps with at most this many token rows run on one thread (weight-streaming bound)
SINGLE_THREAD_MAX_ROWS = 4
T = TypeVar("T")
SPIN_COUNT = "30000"  # GOMP_SPINCOUNT set by `import cothink` (cothink/__init__.py mirrors it)


def step_threads(rows: int, max_threads: int) -> int:
    """Threads for a step computing `rows` token rows when nothing has been measured."""
    return 1 if rows <= SINGLE_THREAD_MAX_ROWS else max(1, max_threads)


@dataclass
class _Bucket:
    """Measured seconds per row (moving average) of each thread count, for steps of similar width."""

    per_row: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    explore_every: int = 8  # grows while exploring confirms the choice, resets when it flips it


class ThreadChooser:
    """Threads per step, chosen by measurement: one thread or `max_threads`, per width bucket
    (steps of 5-8 rows, 9-16, ...). Small steps always take one thread."""

    MIN_EXPLORE, MAX_EXPLORE = 8, 256

    def __init__(self, max_threads: int, alpha: float = 0.3):
        self.max_threads = max(1, max_threads)
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, rows: int) -> int:
        if step_threads(rows, self.max_threads) == 1:
            return 1
        b = self._buckets.setdefault(rows.bit_length(), _Bucket())
        options = (self.max_threads, 1)
        unmeasured = [n for n in options if n not in b.per_row]
        if unmeasured:
            return unmeasured[0]
        best = min(options, key=lambda n: b.per_row[n])
        if b.steps % b.explore_every == b.explore_every - 1:
            return options[1] if best == options[0] else options[0]  # re-try the other one
        return best

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """Record a step of `rows` rows that took `seconds` on `threads` threads."""
        if step_threads(rows, self.max_threads) == 1:
            return
        b = self._buckets.setdefault(rows.bit_length(), _Bucket())
        before = min(b.per_row, key=b.per_row.__getitem__) if len(b.per_row) == 2 else None
        sample = seconds / rows
        old = b.per_row.get(threads)
        retry = before is not None and before != threads
        # a re-try measures afresh (the old figure is from before contention changed); the
        # choice in use follows a moving average
        b.per_row[threads] = sample if old is None or retry else old + self.alpha * (sample - old)
        b.steps += 1
        if retry:
            flipped = min(b.per_row, key=b.per_row.__getitem__) != before
            b.explore_every = self.MIN_EXPLORE if flipped else min(self.MAX_EXPLORE, 2 * b.explore_every)


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
    """fn(*args, **kwargs) on the compute thread, waiting for it (directly if already there)."""
    if threading.current_thread().name.startswith("cothink-compute"):
        return fn(*args, **kwargs)
    return compute_executor().submit(fn, *args, **kwargs).result()


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


def use_threads(n: int) -> None:
    """Set this thread's torch thread count (OpenMP's is per calling thread) when it differs."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
