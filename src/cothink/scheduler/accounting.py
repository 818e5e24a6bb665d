"""What the engine did, for users, metrics and traces: per-coroutine stats, step records, work events.

Fed by the scheduler's postprocess stage; never touches memory.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CoroutineStats:
    """What one coroutine (by name) cost the engine; read by metrics and the evaluation suite."""

    name: str
    forward_passes: int = 0  # steps this coroutine took part in (several works in one step count once)
    tokens_written: int = 0
    tokens_read: int = 0  # view positions read, summed over the coroutine's step items
    queue_wait_s: float = 0.0  # submit -> first scheduled, summed over its works
    works: int = 0
    ttft_s: list[float] = field(default_factory=list)  # per generation: submit -> first token out


@dataclass(frozen=True)
class StepItemRecord:
    coroutine: str
    kind: str
    tokens: int
    view_tokens: int
    priority: str
    patch_blocks: int = 0  # vision tower work the item ran, patches x blocks (an encode's; else 0)


@dataclass(frozen=True)
class StepRecord:
    """One forward pass: when it ran, which coroutines' items it carried and which code ran it."""

    index: int
    start: float  # perf_counter seconds
    end: float
    items: tuple[StepItemRecord, ...]
    # the execution backend's path for the step: "fused" (all decoder layers in one C call), "native"
    # (per-module, C kernels), "torch", "reference"; "" when no forward pass ran
    path: str = ""
    threads: int = 0  # torch threads the forward pass ran on (execution/threads.py); 0: none ran

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.items)


@dataclass(frozen=True)
class WorkEvent:
    """A moment in a work's life, for metrics and traces.

    event: 'submit' (view = the blocks it reads; value = the tokens it first asks for: an extend's
    input, a probe's question, 1 for a generation), 'scheduled' (first time in a step; value = queue
    wait s), 'first_token' (value = time to first token s), 'piece' (a generation's step: value =
    tokens written, text = the text it streamed, possibly empty), 'paused' and 'resumed' (a
    generation), 'finish' (value = seconds since submit; detail = finish reason or error type;
    answer = a probe's choice probabilities when it answered).
    """

    event: str
    coroutine: str
    work: str  # 'extend', 'generate' or 'probe'
    priority: str
    block: str
    time: float
    value: float = 0.0
    detail: str = ""
    view: tuple[str, ...] = ()  # block names, the written block last ('submit' only)
    text: str = ""  # 'piece' only
    answer: tuple[tuple[str, float], ...] = ()  # (choice, probability): a probe's 'finish' only


class Accounting:
    """Bounded per-coroutine stats, the step timeline and the listeners that receive records."""

    def __init__(self, timeline_steps: int = 100_000, max_tracked_coroutines: int = 10_000):
        self.stats: dict[str, CoroutineStats] = {}
        self.timeline: deque[StepRecord] = deque(maxlen=timeline_steps)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.work_listeners: list[Callable[[WorkEvent], None]] = []
        self.max_tracked = max_tracked_coroutines

    def of(self, name: str) -> CoroutineStats:
        stats = self.stats.get(name)
        if stats is None:
            stats = self.stats[name] = CoroutineStats(name)
            # Keep the most recent coroutines only: default names (task names) are unique per task.
            while len(self.stats) > self.max_tracked:
                del self.stats[next(iter(self.stats))]
        return stats

    def event(
        self,
        event: str,
        coroutine: str,
        work: str,
        priority: str,
        block: str,
        value: float = 0.0,
        detail: str = "",
        *,
        view: tuple[str, ...] = (),
        text: str = "",
        answer: tuple[tuple[str, float], ...] = (),
    ) -> None:
        if self.work_listeners:
            now = time.perf_counter()
            record = WorkEvent(
                event, coroutine, work, priority, block, now, value, detail, view, text, answer
            )
            for listener in self.work_listeners:
                listener(record)

    def step(self, record: StepRecord) -> None:
        self.timeline.append(record)
        for listener in self.step_listeners:
            listener(record)
