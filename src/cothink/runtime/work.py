"""Units of work the engine schedules for coroutines: extend, generate, probe.

Each work writes one block (its own or a scratch block) and reads a view. The engine asks each
active work for its step items, runs one forward over all of them, then hands each its logits.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cothink.execution.sampling import Sampler
from cothink.execution.step import StepItem
from cothink.memory.block import Block, view_key
from cothink.runtime.text import IncrementalDecoder
from cothink.scheduler.policy import Priority

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine


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
class Piece:
    """One streamed piece of a generation: new text and the token ids it came from."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "cancelled" or "error"


class Work:
    kind = "work"

    def __init__(self, engine: Engine, name: str, priority: Priority, view: list[Block]):
        self.engine, self.name, self.priority, self.view = engine, name, priority, view
        self.seq = engine._next_seq()
        self.served = 0
        self.submitted = time.perf_counter()
        self.first_scheduled: float | None = None
        self.finished = False
        self.outcome = ""  # how it ended: 'done', a finish reason, 'cancelled' or the error's type

    @property
    def block(self) -> Block:
        return self.view[-1]

    @property
    def reads(self) -> list[Block]:
        """The caller's blocks this work holds while it runs (not its own scratch blocks)."""
        return self.view

    @property
    def is_decode(self) -> bool:
        return False

    def wanted_tokens(self) -> int:
        raise NotImplementedError

    def items(self, n: int) -> list[StepItem]:
        """Step items for n scheduled tokens."""
        raise NotImplementedError

    def on_step(self, logits: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """Stop before the next step; nothing already written is undone."""
        if not self.finished:
            self.fail(asyncio.CancelledError())


class FutureWork(Work):
    """A work whose caller awaits one result (extend, probe)."""

    def __init__(self, engine: Engine, name: str, priority: Priority, view: list[Block]):
        super().__init__(engine, name, priority, view)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()

    def _resolve(self, value: object) -> None:
        self.finished, self.outcome = True, "done"
        if not self.future.done():
            self.future.set_result(value)

    def fail(self, exc: BaseException) -> None:
        self.finished, self.outcome = True, _outcome(exc)
        if not self.future.done():
            if isinstance(exc, asyncio.CancelledError):
                self.future.cancel()
            else:
                self.future.set_exception(exc)


class ExtendWork(FutureWork):
    kind = "extend"

    def __init__(self, engine: Engine, name: str, priority: Priority, view: list[Block], tokens: list[int]):
        super().__init__(engine, name, priority, view)
        self.pending = list(tokens)
        self._chunk = 0

    def wanted_tokens(self) -> int:
        return len(self.pending)

    def items(self, n: int) -> list[StepItem]:
        self._chunk = n
        return [
            StepItem(
                self.block, self.pending[:n], self.view, logits="last" if n == len(self.pending) else "none"
            )
        ]

    def on_step(self, logits: list[torch.Tensor]) -> None:
        del self.pending[: self._chunk]
        if not self.pending:
            self._resolve(None)


class GenerateWork(Work):
    """Samples into view[-1]. A token is emitted once it is written, so the block holds all output."""

    kind = "generate"

    def __init__(
        self,
        engine: Engine,
        name: str,
        priority: Priority,
        view: list[Block],
        sampler: Sampler,
        max_tokens: int,
        stop: tuple[str, ...],
        stop_token_ids: frozenset[int],
    ):
        super().__init__(engine, name, priority, view)
        self.sampler, self.max_tokens = sampler, max_tokens
        self.stop, self.stop_token_ids = stop, stop_token_ids
        self.queue: asyncio.Queue[Piece | GenerationResult | BaseException] = asyncio.Queue()
        self.token_ids: list[int] = []
        self.text = ""  # decoded output so far
        self.sent = 0  # characters of self.text already streamed
        tokenizer = engine.tokenizer
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.pending: int | None = None  # sampled, not yet written
        self._peek: Block | None = None
        cached = self._cached_logits()
        if cached is not None:
            self.pending = sampler(cached)

    def _prefix(self) -> list[Block]:
        """The view up to its last non-empty block: whose last token the next token follows."""
        last = max((i for i, b in enumerate(self.view) if b.length), default=-1)
        return self.view[: last + 1]

    def _cached_logits(self) -> torch.Tensor | None:
        """Logits after the view's last token, if the last write computed them under this same view."""
        prefix = self._prefix()
        cached = prefix[-1].last_logits if prefix else None
        if cached is not None and cached[0] == view_key(prefix):
            return cached[1]
        return None

    @property
    def is_decode(self) -> bool:
        return True

    def wanted_tokens(self) -> int:
        return 1

    def items(self, n: int) -> list[StepItem]:
        if self.pending is not None:
            return [StepItem(self.block, [self.pending], self.view, logits="last")]
        # Recompute the logits after the view's last token in a scratch block that reads the view
        # without that token; nothing in the view is written.
        prefix = self._prefix()
        self._peek = self.engine.runner.new_block(f"{self.name}-peek")
        lengths = [b.length for b in prefix]
        lengths[-1] -= 1
        return [StepItem(self._peek, [prefix[-1].tokens[-1]], [*prefix, self._peek], "last", lengths)]

    def on_step(self, logits: list[torch.Tensor]) -> None:
        if self._peek is not None:
            self.engine.runner.free(self._peek)
            self._peek = None
        else:
            self._emit(self.pending)
            if self.finished:
                return
        self.pending = self.sampler(logits[0][-1])

    def _emit(self, token: int) -> None:
        self.token_ids.append(token)
        if len(self.token_ids) == 1:
            ttft = time.perf_counter() - self.submitted
            self.engine._stats(self.name).ttft_s.append(ttft)
            self.engine._notify(self, "first_token", ttft)
        if token in self.stop_token_ids:
            return self._finish("stop", token)
        if self._decoder is not None:
            searched = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
            self.text += self._decoder.push(token)
            cut = min((i for i in (self.text.find(s, searched) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                return self._finish("stop", token, flush=False)
        if len(self.token_ids) >= self.max_tokens:
            return self._finish("length", token)
        # Hold back anything that could be the beginning of a stop string.
        ready = len(self.text) - max((len(s) - 1 for s in self.stop), default=0)
        piece = self.text[self.sent : ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        self.queue.put_nowait(Piece(piece, [token]))

    def _finish(self, reason: str, token: int | None = None, flush: bool = True) -> None:
        """End the generation; the last piece carries the remaining text and the final token."""
        self.finished, self.outcome = True, reason
        if flush and self._decoder is not None:
            self.text += self._decoder.flush()
        if len(self.text) > self.sent or token is not None:
            self.queue.put_nowait(Piece(self.text[self.sent :], [token] if token is not None else []))
            self.sent = len(self.text)
        self.queue.put_nowait(GenerationResult(self.text, list(self.token_ids), reason))

    def fail(self, exc: BaseException) -> None:
        if self._peek is not None:
            self.engine.runner.free(self._peek)
            self._peek = None
        if self.finished:
            return
        if isinstance(exc, asyncio.CancelledError):
            self._finish("cancelled")
        else:
            self.finished, self.outcome = True, _outcome(exc)
            self.queue.put_nowait(exc)


class ProbeWork(FutureWork):
    """Prefill a question after the view in a scratch block and read the choices' probabilities.

    A choice is scored by the log-probability of its whole token sequence. Single-token choices
    need only the question's forward pass; longer choices add one batched pass over forks of the
    question block (one fork per such choice).
    """

    kind = "probe"

    def __init__(
        self,
        engine: Engine,
        name: str,
        priority: Priority,
        view: list[Block],
        question: list[int],
        choices: dict[str, list[int]],
    ):
        scratch = engine.runner.new_block(f"{name}-probe")
        super().__init__(engine, name, priority, [*view, scratch])
        self.pending = list(question)
        self.choices = choices
        self.scores: dict[str, float] = {}
        self.forks: dict[str, Block] = {}
        self._chunk = 0

    @property
    def reads(self) -> list[Block]:
        return self.view[:-1]

    def wanted_tokens(self) -> int:
        if self.pending:
            return len(self.pending)
        return sum(len(t) - 1 for c, t in self.choices.items() if c not in self.scores) or 1

    def items(self, n: int) -> list[StepItem]:
        if self.pending:
            self._chunk = n
            last = n == len(self.pending)
            return [StepItem(self.block, self.pending[:n], self.view, "last" if last else "none")]
        items = []
        for choice, toks in self.choices.items():
            if choice not in self.scores:
                fork = self.forks[choice] = self.engine.runner.fork(self.block, f"{self.name}-probe-{choice}")
                items.append(StepItem(fork, toks[:-1], [*self.view[:-1], fork], "all"))
        return items

    def on_step(self, logits: list[torch.Tensor]) -> None:
        if self.pending:
            del self.pending[: self._chunk]
            if self.pending:
                return
            first = torch.log_softmax(logits[0][-1].float(), dim=-1)
            for choice, toks in self.choices.items():
                if len(toks) == 1:
                    self.scores[choice] = float(first[toks[0]])
            self._first = first
            if len(self.scores) < len(self.choices):
                return
        else:
            rest = [c for c in self.choices if c not in self.scores]
            for choice, out in zip(rest, logits):
                toks = self.choices[choice]
                logp = torch.log_softmax(out.float(), dim=-1)
                self.scores[choice] = float(self._first[toks[0]]) + sum(
                    float(logp[i, t]) for i, t in enumerate(toks[1:])
                )
        self._release()
        top = max(self.scores.values())
        weights = {c: math.exp(s - top) for c, s in self.scores.items()}
        total = sum(weights.values())
        self._resolve({c: w / total for c, w in weights.items()})

    def _release(self) -> None:
        for fork in self.forks.values():
            if not fork.freed:
                self.engine.runner.free(fork)
        self.forks.clear()
        if not self.block.freed:
            self.engine.runner.free(self.block)

    def fail(self, exc: BaseException) -> None:
        self._release()
        super().fail(exc)


def _outcome(exc: BaseException) -> str:
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
