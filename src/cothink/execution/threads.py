"""How many torch threads a step uses, and how idle OpenMP threads wait.

Measured on a 2-core CPU (docs/benchmarks.md): a decode step of one or a few rows is bound by
streaming the weights, and a second OpenMP thread adds nothing to it; when another process keeps
one core busy, that second thread makes every parallel region wait for the busy core (decode fell
from 15.8 to 5.5 tok/s). Wide steps (prefill chunks, many decoding coroutines) are compute-bound
and use every thread. Idle OpenMP threads spin by default, burning the core the engine's own event
loop, agents and server need: `OMP_WAIT_POLICY=PASSIVE` puts them to sleep instead. libgomp
reads it when torch is loaded, so `import cothink` sets it (unless already set) before torch loads;
a process that imported torch first keeps its policy.
"""

from __future__ import annotations

import torch

# steps with at most this many token rows run on one thread (weight-streaming bound)
SINGLE_THREAD_MAX_ROWS = 4


def step_threads(rows: int, max_threads: int) -> int:
    """Threads for a step computing `rows` token rows, given the engine's thread limit."""
    return 1 if rows <= SINGLE_THREAD_MAX_ROWS else max(1, max_threads)


def use_threads(n: int) -> None:
    """Set this thread's torch thread count (OpenMP's is per calling thread) when it differs."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
