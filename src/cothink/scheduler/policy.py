"""Which work runs in the next step: continuous batching under a token budget, with priorities.

Order of service (network flow control in spirit):
1. priority class, strictly: interactive before background, except that background work waiting
   for service is guaranteed `background_min_tokens` of every step so it never starves;
2. within a class, decode (one token each) before prefill chunks;
3. within those, weighted fair sharing between *coroutines* (not works): lowest virtual time
   (tokens served to the coroutine / weight) first, so a coroutine that submits many short works
   gets the same share as one that submits one long work.

Latency bound: while an interactive generation is decoding, a step carries at most
`interactive_step_tokens` tokens in all (background work's reserve shrinks to fit, but to no less
than one token, so background never starves): background prefill chunks and decode tokens wait,
and each interactive token costs about one small step. In such a step a background prefill chunk
carries at most `interactive_background_chunk` tokens (default 1): a step whose items are all single
tokens stays on the native backend's fused decode path, which a multi-token chunk would leave for the
slower per-module path (bench/interactive_steps.py measures both). A step that carries an interactive
prefill chunk (a prompt, a probe's question) and no interactive decoder takes background work only
up to its reserve, `background_min_tokens`: the interactive prompt's first token waits for its own
chunk, not for a full step of background prefill beside it (time to first token).
An interactive item of q tokens, behind d interactive decoders and no other interactive prefill,
is fully served within ceil(q / min(max_prefill_chunk, max_batch_tokens - background_min_tokens - d))
steps, however much background work is queued.

A prompt that is the only runnable work (nothing decodes, nothing else waits) takes chunks of up to
`lone_prefill_chunk` tokens (default 512), beyond `max_prefill_chunk` and `max_batch_tokens`: nobody
shares its steps, and wider chunks cost less per token (each step re-reads every weight, and a
quantized model dequantizes every weight per step: a lone 2048-token prompt on SmolLM2, two Zen 4
cores, at 512-token chunks instead of 128: bfloat16 +5-10%, int4 +30%). A coroutine that arrives
meanwhile waits for at most one such chunk before its own work is planned.

Vision encoding keeps the same bound: an encode runs at most `vision_step_patch_blocks` of tower
work (patches x blocks) per step, about what a `max_prefill_chunk` text chunk costs, and while an
interactive generation decodes, a background encode may add to a step only what background text
prefill may, counted in the decoder's multiply-adds (`encode_step_patch_blocks`); the tower is cut
between the rows of a block's two phases, and at least one row runs per step, so an encode always
advances.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Protocol

from cothink.errors import InvalidParameterError


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
            raise InvalidParameterError(
                f"priority must be 'interactive', 'background' or a Priority, got {value!r}", param="priority"
            ) from None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise InvalidParameterError("priority weight must be > 0", param="priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 256
    max_batch_items: int = 64
    max_prefill_chunk: int = 128
    background_min_tokens: int = 16
    interactive_step_tokens: int = 4  # step size cap while an interactive generation decodes
    interactive_background_chunk: int = 1  # a background prefill chunk's cap while one decodes
    lone_prefill_chunk: int = 512  # a prompt's chunk when it is the only runnable work (module doc)
    # Vision tower work one step may run: patches x blocks of the image or frame group being encoded
    # (at least one row of a block's phase). The default is about one default max_prefill_chunk
    # (128 tokens) of text prefill on a small decoder: the released Qwen3.5 tower (27 blocks, hidden
    # 1152) runs a patch-block in ~0.23 ms fp32 on two CPU threads (a 640 x 480 image, 1200 patches x
    # 27 blocks, in 7.3 s), so 2048 patch-blocks take ~0.46 s, about a 128-token chunk of the embedded
    # SmolLM2-135M there (300-450 tokens/s); in FLOPs (~35 MFLOPs a patch-block, 2 x parameters a text
    # token) it is the chunk of a ~0.3B decoder. That image then takes about 16 steps.
    vision_step_patch_blocks: int = 2048

    def __post_init__(self) -> None:
        if min(self.max_batch_tokens, self.max_batch_items, self.max_prefill_chunk) < 1:
            raise InvalidParameterError("scheduler limits must be >= 1", param="max_batch_tokens")
        if not 0 <= self.background_min_tokens < self.max_batch_tokens:
            raise InvalidParameterError(
                "background_min_tokens must be in [0, max_batch_tokens)", param="background_min_tokens"
            )
        for name in ("interactive_step_tokens", "interactive_background_chunk", "lone_prefill_chunk"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be >= 1", param=name)
        if self.vision_step_patch_blocks < 1:
            raise InvalidParameterError(
                "vision_step_patch_blocks must be >= 1", param="vision_step_patch_blocks"
            )


def interactive_decoding(works: Iterable[Schedulable]) -> bool:
    """Whether an interactive generation is among the works (the latency bound applies)."""
    return any(w.is_decode and w.priority.klass == PriorityClass.INTERACTIVE for w in works)


def encode_step_patch_blocks(
    cfg: SchedulerConfig, klass: PriorityClass, interactive_decode: bool, tokens_per_patch_block: float
) -> float:
    """The tower work (patches x blocks) an encode may run in one step: `vision_step_patch_blocks`;
    for a background encode while an interactive generation decodes, what background text prefill
    may add to that step (interactive_step_tokens - 1 tokens, at least 1) in the decoder's
    multiply-adds (`tokens_per_patch_block`: one patch-block's in text tokens), never above
    `vision_step_patch_blocks`. The encode runs at least one row of a block's phase
    (`VisionTower.run`)."""
    if klass == PriorityClass.BACKGROUND and interactive_decode:
        tokens = max(1, cfg.interactive_step_tokens - 1)
        return min(float(cfg.vision_step_patch_blocks), tokens / tokens_per_patch_block)
    return float(cfg.vision_step_patch_blocks)


class Schedulable(Protocol):
    coroutine: str
    priority: Priority
    seq: int

    @property
    def is_decode(self) -> bool: ...

    def wanted_tokens(self) -> int: ...


class Admission(Enum):
    ADMIT = "admit"
    WAIT = "wait"  # not now: memory may free up
    FAIL = "fail"  # never, or waited too long


@dataclass
class FairShares:
    """Weighted virtual time per (class, coroutine): tokens served / weight.

    Only coroutines with runnable work have an entry. A coroutine that becomes runnable starts at
    the smallest virtual time of its class (no credit for having been idle, no debt either), so
    shares follow weights over any window of steps.
    """

    vtime: dict[tuple[PriorityClass, str], float] = field(default_factory=dict)

    def refresh(self, works: Iterable[Schedulable]) -> None:
        active = {(w.priority.klass, w.coroutine) for w in works}
        for key in [k for k in self.vtime if k not in active]:
            del self.vtime[key]
        for key in active - self.vtime.keys():
            same_class = [v for (klass, _), v in self.vtime.items() if klass == key[0]]
            self.vtime[key] = min(same_class, default=0.0)

    def of(self, work: Schedulable) -> float:
        return self.vtime.get((work.priority.klass, work.coroutine), 0.0)

    def charge(self, work: Schedulable, tokens: int) -> None:
        key = (work.priority.klass, work.coroutine)
        self.vtime[key] = self.vtime.get(key, 0.0) + tokens / work.priority.weight


@dataclass
class StepChoice:
    chosen: list[tuple[Schedulable, int]] = field(default_factory=list)  # (work, tokens this step)
    refused: list[Schedulable] = field(default_factory=list)  # admission said FAIL


class StepPolicy(Protocol):
    """How one step is chosen (`plan_step` is the engine's). A replacement keeps its contract: pure
    apart from calling `admit`, at most `max_batch_items` works and `max_batch_tokens` tokens (or one
    lone prompt's chunk of up to `lone_prefill_chunk`)."""

    def __call__(
        self,
        works: list[Schedulable],
        cfg: SchedulerConfig,
        shares: FairShares,
        admit: Callable[[Schedulable, int], Admission],
    ) -> StepChoice: ...


def plan_step(
    works: list[Schedulable],
    cfg: SchedulerConfig,
    shares: FairShares,
    admit: Callable[[Schedulable, int], Admission],
) -> StepChoice:
    """Choose (work, tokens) pairs for one step; `admit(work, n)` answers for memory.

    Pure apart from calling `admit`: it neither changes the works nor fails them.
    """
    choice = StepChoice()
    shares.refresh(works)
    interactive_decode = any(w.is_decode and w.priority.klass == PriorityClass.INTERACTIVE for w in works)
    # While an interactive generation decodes, background work fills the step only up to this size.
    background_cap = cfg.interactive_step_tokens if interactive_decode else cfg.max_batch_tokens
    budget = cfg.max_batch_tokens
    chunk = cfg.max_prefill_chunk
    if len(works) == 1 and not works[0].is_decode and not getattr(works[0], "computes", False):
        # a lone prompt: no other work to share the step with (module doc)
        chunk = max(chunk, cfg.lone_prefill_chunk)
        budget = max(budget, chunk)
    waiting_background = any(w.priority.klass == PriorityClass.BACKGROUND for w in works)
    reserve = cfg.background_min_tokens if waiting_background else 0
    if interactive_decode:  # the cap holds the reserve too, leaving the interactive token its room
        reserve = min(reserve, max(1, background_cap - 1))
    order = sorted(works, key=lambda w: (w.priority.klass, not w.is_decode, shares.of(w), w.seq))
    interactive_prefill = False  # an interactive prefill chunk is in this step
    for work in order:
        if len(choice.chosen) == cfg.max_batch_items:
            break
        used = cfg.max_batch_tokens - budget
        if work.priority.klass == PriorityClass.BACKGROUND:
            # beside an interactive prefill, background adds only its reserve: the step stays short
            cap = 0 if interactive_prefill and not interactive_decode else background_cap
            room = min(budget, max(reserve, cap - used))
            if interactive_decode:  # single-token pieces keep the step on the fused decode path
                room = min(room, cfg.interactive_background_chunk)
        else:
            room = budget - reserve
        n = 1 if work.is_decode else min(work.wanted_tokens(), chunk, room)
        if n < 1 or n > room:
            continue
        verdict = admit(work, n)
        if verdict is Admission.FAIL:
            choice.refused.append(work)
            continue
        if verdict is Admission.WAIT:
            continue
        choice.chosen.append((work, n))
        budget -= n
        if work.priority.klass == PriorityClass.BACKGROUND:
            reserve = max(0, reserve - n)
        elif not work.is_decode:
            interactive_prefill = True
    return choice
