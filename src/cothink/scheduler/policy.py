"""Which work runs in the next step: continuous batching under a token budget, with priorities.

Order of service (network flow control in spirit):
1. priority class, strictly: interactive before background, except that background work waiting
   for service is guaranteed `background_min_tokens` of every step so it never starves;
2. within a class, decode (one token each) before prefill chunks;
3. within those, weighted fair sharing: lowest virtual time (tokens served / weight) first.

Bound: an interactive item of q tokens, behind d interactive decoders and no other interactive
prefill, is fully served within ceil(q / min(max_prefill_chunk, max_batch_tokens - background_min_tokens - d))
steps, however much background work is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class PriorityClass(IntEnum):
    INTERACTIVE = 0
    BACKGROUND = 1


@dataclass(frozen=True)
class Priority:
    klass: PriorityClass = PriorityClass.BACKGROUND
    weight: float = 1.0

    @staticmethod
    def parse(value: Priority | str | None, default: PriorityClass) -> Priority:
        if value is None:
            return Priority(default)
        if isinstance(value, Priority):
            return value
        try:
            return Priority(PriorityClass[str(value).upper()])
        except KeyError:
            raise ValueError(
                f"priority must be 'interactive', 'background' or a Priority, got {value!r}"
            ) from None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError("priority weight must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 256
    max_batch_items: int = 64
    max_prefill_chunk: int = 128
    background_min_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_batch_items < 1 or self.max_prefill_chunk < 1:
            raise ValueError("scheduler limits must be >= 1")
        if not 0 <= self.background_min_tokens < self.max_batch_tokens:
            raise ValueError("background_min_tokens must be in [0, max_batch_tokens)")


class Schedulable(Protocol):
    priority: Priority
    seq: int
    served: int

    @property
    def is_decode(self) -> bool: ...

    def wanted_tokens(self) -> int: ...


def _key(work: Schedulable) -> tuple:
    return (work.priority.klass, not work.is_decode, work.served / work.priority.weight, work.seq)


def plan_step(works: list[Schedulable], cfg: SchedulerConfig, fits) -> list[tuple[Schedulable, int]]:
    """Choose (work, tokens) pairs for one step. `fits(work, n)` admits n tokens of work against memory."""
    chosen: list[tuple[Schedulable, int]] = []
    budget = cfg.max_batch_tokens
    waiting_background = any(w.priority.klass == PriorityClass.BACKGROUND for w in works)
    reserve = cfg.background_min_tokens if waiting_background else 0
    for work in sorted(works, key=_key):
        if len(chosen) == cfg.max_batch_items:
            break
        room = budget if work.priority.klass == PriorityClass.BACKGROUND else budget - reserve
        wanted = work.wanted_tokens()
        n = 1 if work.is_decode else min(wanted, cfg.max_prefill_chunk, room)
        if n < 1 or n > room or not fits(work, n):
            continue
        chosen.append((work, n))
        budget -= n
        if work.priority.klass == PriorityClass.BACKGROUND:
            reserve = max(0, reserve - n)
    return chosen
