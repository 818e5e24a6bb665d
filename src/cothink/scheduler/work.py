"""Works: the request state of extend, generate, probe and vision-encode calls.

A work is plain state: no reference to the engine, no allocation or sampling in its constructor.
The scheduler asks it for step items (`items`, which may allocate scratch blocks through the
runner), runs the step, hands it its logits (`after_step`) and, for a generation, the token the
batched sampling stage picked (`accept`). Results leave through the work's future or queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from cothink.execution.runner import ModelRunner
from cothink.execution.sampling import Sampled, SamplerState, TokenLogprob
from cothink.execution.step import StepItem, VisionChunk
from cothink.memory.block import Block, VisionSpan, span_at
from cothink.memory.store import BlockStore
from cothink.models.vision import EncodeState, PatchGrid, VisionFeatures
from cothink.models.text import IncrementalDecoder
from cothink.scheduler.policy import Priority, SchedulerConfig, encode_step_patch_blocks


@dataclass(frozen=True)
class Piece:
    """One streamed piece of a generation: new text, the token ids it came from and, when the
    generation asked for them, each token's log-probabilities."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "cancelled" or "error"


@dataclass(frozen=True)
class Growth:
    """Memory a step of a work takes: `block` (None for a scratch block it will create) grows to
    `length` tokens; with `fork`, a copy-on-write fork of `block` does."""

    block: Block | None
    length: int
    fork: bool = False
    extra_bytes: int = 0  # memory outside blocks the step creates (vision features)


class Work:
    kind: ClassVar[str] = "work"
    # whether a step of this work runs `compute` on the compute thread (work that is not a forward pass)
    computes: ClassVar[bool] = False

    def __init__(self, coroutine: str, priority: Priority, view: list[Block], seq: int):
        self.coroutine, self.priority, self.view, self.seq = coroutine, priority, view, seq
        self.submitted = time.perf_counter()
        self.first_scheduled: float | None = None
        self.served = 0  # tokens written for this work
        self.finished = False
        self.outcome = ""  # how it ended: 'done', a finish reason, 'cancelled' or the error's type
        self.deadline: float | None = None  # time.perf_counter() after which it is dropped unrun
        self.answer: dict[str, float] | None = None  # a probe's choice probabilities, once answered

    @property
    def block(self) -> Block:
        """The block this work writes."""
        return self.view[-1]

    @property
    def reads(self) -> list[Block]:
        """The caller's blocks this work holds while it is registered (not its scratch blocks)."""
        return self.view

    @property
    def writes_caller_block(self) -> bool:
        return True

    @property
    def target_name(self) -> str:
        """The name of the block this work writes (for logs and events)."""
        return self.block.name

    @property
    def runnable(self) -> bool:
        return not self.finished

    @property
    def is_decode(self) -> bool:
        return False

    def wanted_tokens(self) -> int:
        raise NotImplementedError

    def growth(self, n: int) -> list[Growth]:
        return [Growth(self.block, self.block.length + n)]

    def items(self, n: int, runner: ModelRunner) -> list[StepItem]:
        """Step items for n scheduled tokens (scratch blocks are allocated here, never earlier)."""
        raise NotImplementedError

    def after_step(self, logits: list[torch.Tensor], runner: ModelRunner) -> None:
        """Take this work's logits from a step (scratch blocks it no longer needs are freed)."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """Stop before the next step; nothing already written is undone."""
        if not self.finished:
            self.fail(asyncio.CancelledError())

    def scratch_blocks(self) -> list[Block]:
        """Hand over the work's scratch blocks for freeing (when the work leaves the scheduler)."""
        return []

    def cost(self, n: int) -> int:
        """What a step of n scheduled tokens costs this work's coroutine in its fair share."""
        return n

    def compute_budget(self, cfg: SchedulerConfig, interactive_decode: bool) -> float:
        """The vision tower work (patches x blocks) a step may give this work (`computes` works)."""
        return 0.0

    def plan_compute(self, patch_blocks: float) -> None:
        """The vision tower work (patches x blocks) this step's `compute` may run (`computes` works;
        the scheduler tells it before `items`)."""

    def compute(self, runner: ModelRunner) -> None:
        """This step's work other than the forward pass (`computes`), on the compute thread. It
        never raises: a failure is kept and raised by `after_step` on the event loop."""

    def step_patch_blocks(self) -> int:
        """The vision tower work (patches x blocks) its last step's `compute` ran; 0 for none."""
        return 0

    def successor(self) -> Work | None:
        """The work that continues this one once it has finished well (submitted in its place)."""
        return None

    def release_memory(self, store: BlockStore) -> None:
        """Give back memory outside blocks that the work holds (when it leaves the scheduler)."""


class FutureWork(Work):
    """A work whose caller awaits one result (extend, probe)."""

    def __init__(self, coroutine: str, priority: Priority, view: list[Block], seq: int):
        super().__init__(coroutine, priority, view, seq)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()

    def _resolve(self, value: object) -> None:
        self.finished, self.outcome = True, "done"
        if not self.future.done():
            self.future.set_result(value)

    def fail(self, exc: BaseException) -> None:
        if self.finished:
            return
        self.finished, self.outcome = True, outcome_of(exc)
        if not self.future.done():
            if isinstance(exc, asyncio.CancelledError):
                self.future.cancel()
            else:
                self.future.set_exception(exc)


@dataclass(frozen=True)
class VisionUnit:
    """One image or frame group of an extend: its patches, and where its placeholders sit among the
    extend's tokens."""

    pixels: torch.Tensor  # [grid.patches, patch_dim]
    grid: PatchGrid  # t = 1
    offset: int  # the extend's token index of its first placeholder
    rows: int  # merged grid rows
    cols: int  # merged grid columns

    @property
    def tokens(self) -> int:
        return self.rows * self.cols


@dataclass
class VisionInput:
    """The images and frame groups of one extend, and their features once encoded (transient memory:
    counted in the store's vision_bytes from encoding until the extend leaves the scheduler)."""

    units: list[VisionUnit]
    features: list[VisionFeatures] = field(default_factory=list)  # per encoded unit, in order
    held_bytes: int = 0

    def runs(self) -> list[VisionSpan]:
        """The units' placeholder runs, at their token indices in the extend."""
        return [VisionSpan(u.offset, u.rows, u.cols) for u in self.units]

    def keep(self, features: VisionFeatures, store: BlockStore) -> None:
        self.features.append(features)
        nbytes = feature_bytes(features)
        self.held_bytes += nbytes
        store.vision_bytes += nbytes

    def drop(self, store: BlockStore) -> None:
        """Release the features (idempotent)."""
        store.vision_bytes -= self.held_bytes
        self.held_bytes = 0
        self.features = []

    def chunk(self, a: int, b: int, base: int) -> VisionChunk | None:
        """The vision part of the extend's tokens a..b-1, for a block that held `base` tokens before
        the extend; None when none of them is a placeholder."""
        runs, rows, feats, stacks = [], [], [], []
        for unit, f in zip(self.units, self.features, strict=True):
            lo, hi = max(a, unit.offset), min(b, unit.offset + unit.tokens)
            if lo >= hi:
                continue
            if a <= unit.offset < b:
                runs.append(VisionSpan(base + unit.offset, unit.rows, unit.cols))
            rows.append(torch.arange(lo - a, hi - a))
            feats.append(f.merged[lo - unit.offset : hi - unit.offset])
            stacks.append([d[lo - unit.offset : hi - unit.offset] for d in f.deepstack])
        if not rows:
            return None
        deepstack = tuple(torch.cat(layer) for layer in zip(*stacks))
        return VisionChunk(tuple(runs), torch.cat(rows), torch.cat(feats), deepstack)


def feature_bytes(features: VisionFeatures) -> int:
    return sum(t.numel() * t.element_size() for t in (features.merged, *features.deepstack))


class ExtendWork(FutureWork):
    kind = "extend"

    def __init__(
        self, coroutine: str, priority: Priority, view: list[Block], seq: int, tokens: list[int],
        vision: VisionInput | None = None,
    ):
        super().__init__(coroutine, priority, view, seq)
        self.pending = list(tokens)
        self.total = len(tokens)
        self.vision = vision  # images or frame groups among the tokens (encoded by an EncodeWork first)
        self._runs = vision.runs() if vision is not None else []
        self._chunk = 0

    def wanted_tokens(self) -> int:
        return len(self.pending)

    def items(self, n: int, runner: ModelRunner) -> list[StepItem]:
        self._chunk = n
        last = n == len(self.pending)
        item = StepItem(self.block, self.pending[:n], self.view, "last" if last else "none")
        if self.vision is not None:
            done = self.total - len(self.pending)
            item.vision = self.vision.chunk(done, done + n, self.block.length - done)
            # the block's position counter continues from its span before the extend
            item.span_added = span_at(self._runs, done + n) - span_at(self._runs, done)
        return [item]

    def after_step(self, logits: list[torch.Tensor], runner: ModelRunner) -> None:
        del self.pending[: self._chunk]
        if not self.pending:
            self._resolve(None)

    def release_memory(self, store: BlockStore) -> None:
        if self.vision is not None:
            self.vision.drop(store)


@dataclass(frozen=True)
class TowerSizes:
    """What scheduling an encode needs to know of the vision tower."""

    depth: int  # blocks
    feature_row_bytes: int  # one placeholder's features (merged + DeepStack)
    patch_state_bytes: int  # one patch's part of the tower state kept between steps (EncodeState)
    tokens_per_patch_block: float = 1.0  # one patch-block's multiply-adds in text prefill tokens


class EncodeWork(Work):
    """Encode an extend's images and frame groups with the vision tower on the compute thread, one
    image or frame group at a time and a bounded part of it per step (the step's patch-block budget,
    cut between the rows of a block's phases, at least one row: `plan_compute`); then hand over to
    the extend that writes them (`successor`).

    It is the writer of the extend's block from submission (other writers get BlockBusyError), so
    the block is untouched until every image is encoded: a failure leaves it as it was. An image's
    tower state lives between its steps: its memory (the state and the image's features) is
    admitted when the image starts and counted in the store's vision_bytes until the image is done
    (then only its features stay) or the work leaves the scheduler. Its cost for the scheduler is
    the image's placeholder count, spread over the image's steps by the work each runs."""

    kind = "encode"
    computes = True

    def __init__(self, coroutine: str, priority: Priority, seq: int, extend: ExtendWork, tower: TowerSizes):
        super().__init__(coroutine, priority, extend.view, seq)
        assert extend.vision is not None
        self.extend, self.vision, self.tower = extend, extend.vision, tower
        self._state: EncodeState | None = None  # the image being encoded, between its steps
        self._reserved = 0  # bytes counted in store.vision_bytes for that image
        self._budget = 0.0  # patch-blocks this step may run
        self._progress = 0.0  # patch-blocks of the image run so far
        self._ran = 0.0  # patch-blocks the last step ran
        self._result: VisionFeatures | BaseException | None = None  # None: the image goes on

    @property
    def _next(self) -> VisionUnit:
        return self.vision.units[len(self.vision.features)]

    def _unit_bytes(self, unit: VisionUnit) -> int:
        """An image's peak memory while encoded: its tower state and its features."""
        return unit.grid.patches * self.tower.patch_state_bytes + unit.tokens * self.tower.feature_row_bytes

    def wanted_tokens(self) -> int:
        return self._next.tokens

    def growth(self, n: int) -> list[Growth]:
        extra = 0 if self._reserved else self._unit_bytes(self._next)  # held from the image's start
        return [Growth(None, 0, extra_bytes=extra)]

    def compute_budget(self, cfg: SchedulerConfig, interactive_decode: bool) -> float:
        return encode_step_patch_blocks(
            cfg, self.priority.klass, interactive_decode, self.tower.tokens_per_patch_block)

    def plan_compute(self, patch_blocks: float) -> None:
        self._budget = patch_blocks

    def cost(self, n: int) -> int:
        """The image's placeholders in proportion to the work this step runs (summing to them)."""
        tokens, total = self._next.tokens, self.tower.depth * self._next.grid.patches
        done = self._progress
        if done + self._budget >= total:
            return tokens - int(tokens * done // total)
        return int(tokens * (done + self._budget) // total) - int(tokens * done // total)

    def items(self, n: int, runner: ModelRunner) -> list[StepItem]:
        if not self._reserved:  # the image starts this step
            self._reserved = self._unit_bytes(self._next)
            runner.store.vision_bytes += self._reserved
        return []

    def compute(self, runner: ModelRunner) -> None:
        unit, self._ran = self._next, 0.0
        try:
            vision = runner.vision
            assert vision is not None
            if self._state is None:
                self._state = vision.start(unit.pixels, unit.grid)
            self._ran = vision.run(self._state, self._budget)
            self._progress += self._ran
            if self._state.done == self.tower.depth:
                self._result = vision.finish(self._state)
        except Exception as exc:  # raised on the event loop by after_step
            self._result = exc

    def step_patch_blocks(self) -> int:
        return max(1, round(self._ran)) if self._ran else 0

    def after_step(self, logits: list[torch.Tensor], runner: ModelRunner) -> None:
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        if result is None:  # the image continues in a later step
            return
        self._release_state(runner.store)
        self.vision.keep(result, runner.store)
        self.served += self.vision.units[len(self.vision.features) - 1].tokens
        if len(self.vision.features) == len(self.vision.units):
            self.finished, self.outcome = True, "done"

    def _release_state(self, store: BlockStore) -> None:
        store.vision_bytes -= self._reserved
        self._reserved, self._state, self._progress = 0, None, 0.0

    def successor(self) -> Work | None:
        return self.extend if self.outcome == "done" else None

    def fail(self, exc: BaseException) -> None:
        if self.finished:
            return
        self.finished, self.outcome = True, outcome_of(exc)
        self.extend.fail(exc)

    def release_memory(self, store: BlockStore) -> None:
        self._release_state(store)  # an image cut off mid-way
        if self.outcome != "done":  # the extend never runs: its features go now
            self.vision.drop(store)


@dataclass
class StopRule:
    """When a generation ends: token budget, stop token ids, stop strings."""

    max_tokens: int
    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()

    @property
    def holdback(self) -> int:
        """Characters held back from streaming because they may begin a stop string."""
        return max((len(s) - 1 for s in self.strings), default=0)


@dataclass
class GenerationOutput:
    """What a generation has produced so far (text is decoded incrementally)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    logprobs: list[TokenLogprob] = field(default_factory=list)


class GenerateWork(Work):
    """Samples into view[-1]. A token is emitted once it is written, so the block holds all output.

    The Piece protocol: a token's two-step life.
    1. Sampled: the scheduler's batched stage picks it (`accept`) from the logits of the step that
       wrote the previous token. It waits in `pending`; it is not output yet.
    2. Written: the next step appends it to the block and `after_step` emits it: it joins the
       output and exactly one Piece carries it, with the text it completed (text that may begin a
       stop string is held back until it cannot).
    A token that ends the generation is emitted the same way: the stop token (in `token_ids`, its
    text not in the output), the token that completes a stop string or a constraint, the
    `max_tokens`-th token. Its piece carries the remaining text, and the GenerationResult follows
    as the queue's last item. Ending without a token (cancelled, context full, engine stopping)
    drops a sampled token that no step wrote, and puts the text still held back (a possible stop
    string's start, bytes the decoder waited on), if any, in a last piece with no token ids. So
    the pieces' token ids and texts, concatenated, are the result's.

    Pausing keeps `pending`, the sampler's generator and the output, so a resumed generation
    continues exactly as if it had never stopped.
    """

    kind = "generate"

    def __init__(
        self,
        coroutine: str,
        priority: Priority,
        view: list[Block],
        seq: int,
        sampler: SamplerState,
        stop: StopRule,
        tokenizer,
    ):
        super().__init__(coroutine, priority, view, seq)
        self.sampler, self.stop = sampler, stop
        self.queue: asyncio.Queue[Piece | GenerationResult | BaseException] = asyncio.Queue()
        self.out = GenerationOutput()
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.pending: int | None = None  # sampled, not yet written
        self.next_logits: torch.Tensor | None = None  # from the last step, not sampled yet
        self.paused = False
        self._peek: Block | None = None
        self._logprob: TokenLogprob | None = None  # of the pending token

    @property
    def runnable(self) -> bool:
        return not self.finished and not self.paused

    @property
    def is_decode(self) -> bool:
        return True

    def wanted_tokens(self) -> int:
        return 1

    def prefix(self) -> list[Block]:
        """The view up to its last non-empty block: whose last token the next token follows."""
        last = max((i for i, b in enumerate(self.view) if b.readable_length), default=-1)
        return self.view[: last + 1]

    def growth(self, n: int) -> list[Growth]:
        if self.pending is None and self.next_logits is None:
            return [Growth(None, 1)]  # the peek block
        return [Growth(self.block, self.block.length + 1)]

    def items(self, n: int, runner: ModelRunner) -> list[StepItem]:
        if self.pending is not None:
            return [StepItem(self.block, [self.pending], self.view, logits="last")]
        # Recompute the logits after the view's last token in a scratch block that reads the view
        # without that token; nothing in the view is written.
        prefix = self.prefix()
        self._peek = runner.new_block(f"{self.coroutine}-peek")
        lengths = [b.readable_length for b in prefix]
        lengths[-1] -= 1
        last = prefix[-1].tokens[lengths[-1]]
        return [StepItem(self._peek, [last], [*prefix, self._peek], "last", lengths)]

    def after_step(self, logits: list[torch.Tensor], runner: ModelRunner) -> None:
        if self._peek is not None:
            runner.free(self._peek)
            self._peek = None
        else:
            self._emit(self.pending)
            if self.finished:
                return
        self.next_logits = logits[0][-1]

    def accept(self, sampled: Sampled) -> None:
        """The batched sampling stage picked the next token. A constraint that cannot follow it
        raises (CothinkError) before the token is pending, so it is never written."""
        if self.sampler.constraint is not None:
            self.sampler.constraint.advance(sampled.token_id)
        self.pending, self._logprob, self.next_logits = sampled.token_id, sampled.logprob, None

    def _emit(self, token: int) -> None:
        out = self.out
        out.token_ids.append(token)
        logprobs = None
        if self._logprob is not None:
            out.logprobs.append(self._logprob)
            logprobs = [self._logprob]
        self.pending = None
        if token in self.stop.token_ids:  # a stop token ends the output; its text is not part of it
            return self._finish("stop", token, logprobs)
        if self._decoder is not None:
            searched = max(0, len(out.text) - max((len(s) for s in self.stop.strings), default=0))
            out.text += self._decoder.push(token)
            found = [i for i in (out.text.find(s, searched) for s in self.stop.strings) if i >= 0]
            if found:
                out.text = out.text[: min(found)]
                return self._finish("stop", token, logprobs, flush=False)
        constraint = self.sampler.constraint
        if constraint is not None and constraint.done():  # the token that completed it is kept
            return self._finish("stop", token, logprobs)
        if len(out.token_ids) >= self.stop.max_tokens:
            return self._finish("length", token, logprobs)
        ready = len(out.text) - self.stop.holdback
        piece = out.text[out.sent : ready] if ready > out.sent else ""
        out.sent = max(out.sent, ready)
        self.queue.put_nowait(Piece(piece, [token], logprobs))

    def end(self, reason: str) -> None:
        """End the generation now (context full, cancelled, engine stopping)."""
        if not self.finished:
            self._finish(reason)

    def _finish(
        self, reason: str, token: int | None = None, logprobs: list | None = None, flush: bool = True
    ) -> None:
        """The last piece carries the remaining text and the final token."""
        self.finished, self.outcome = True, reason
        out = self.out
        if flush and self._decoder is not None:
            out.text += self._decoder.flush()
        if len(out.text) > out.sent or token is not None:
            tokens = [token] if token is not None else []
            self.queue.put_nowait(Piece(out.text[out.sent :], tokens, logprobs))
            out.sent = len(out.text)
        self.queue.put_nowait(self.result(reason))

    def result(self, reason: str) -> GenerationResult:
        return GenerationResult(self.out.text, list(self.out.token_ids), reason)

    def fail(self, exc: BaseException) -> None:
        if self.finished:
            return
        if isinstance(exc, asyncio.CancelledError):
            self._finish("cancelled")
        else:
            self.finished, self.outcome = True, outcome_of(exc)
            self.queue.put_nowait(exc)

    def scratch_blocks(self) -> list[Block]:
        peek, self._peek = self._peek, None
        return [peek] if peek is not None else []


class ProbeWork(FutureWork):
    """Prefill a question after the view in a scratch block and read the choices' probabilities.

    A choice is scored by the log-probability of its whole token sequence. Single-token choices
    need only the question's forward pass; longer choices add one batched pass over forks of the
    question block (one fork per such choice).
    """

    kind = "probe"

    def __init__(
        self,
        coroutine: str,
        priority: Priority,
        view: list[Block],
        seq: int,
        question: list[int],
        choices: dict[str, list[int]],
    ):
        super().__init__(coroutine, priority, view, seq)
        self.pending = list(question)
        self.choices = choices
        self.scores: dict[str, float] = {}
        self.scratch: Block | None = None
        self.forks: dict[str, Block] = {}
        self._first: torch.Tensor | None = None
        self._chunk = 0

    @property
    def block(self) -> Block:
        raise AttributeError("a probe writes only its own scratch block")

    @property
    def writes_caller_block(self) -> bool:
        return False

    @property
    def target_name(self) -> str:
        return self.scratch.name if self.scratch is not None else f"{self.coroutine}-probe"

    def wanted_tokens(self) -> int:
        if self.pending:
            return len(self.pending)
        return sum(len(t) - 1 for c, t in self.choices.items() if c not in self.scores) or 1

    def growth(self, n: int) -> list[Growth]:
        if self.pending:
            return [Growth(self.scratch, (self.scratch.length if self.scratch else 0) + n)]
        # each multi-token choice forks the question block and appends its tokens but the last
        return [
            Growth(self.scratch, self.scratch.length + len(t) - 1, fork=True)
            for c, t in self.choices.items()
            if c not in self.scores
        ]

    def items(self, n: int, runner: ModelRunner) -> list[StepItem]:
        if self.scratch is None:
            self.scratch = runner.new_block(f"{self.coroutine}-probe")
        if self.pending:
            self._chunk = n
            last = n == len(self.pending)
            view = [*self.view, self.scratch]
            return [StepItem(self.scratch, self.pending[:n], view, "last" if last else "none")]
        items = []
        for choice, toks in self.choices.items():
            if choice not in self.scores:
                fork = self.forks[choice] = runner.fork(self.scratch, f"{self.coroutine}-probe-{choice}")
                items.append(StepItem(fork, toks[:-1], [*self.view, fork], "all"))
        return items

    def after_step(self, logits: list[torch.Tensor], runner: ModelRunner) -> None:
        if self.pending:
            del self.pending[: self._chunk]
            if self.pending:
                return
            self._first = torch.log_softmax(logits[0][-1].float(), dim=-1)
            for choice, toks in self.choices.items():
                if len(toks) == 1:
                    self.scores[choice] = float(self._first[toks[0]])
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
        top = max(self.scores.values())
        weights = {c: math.exp(s - top) for c, s in self.scores.items()}
        total = sum(weights.values())
        self.answer = {c: w / total for c, w in weights.items()}
        self._resolve(dict(self.answer))  # the caller's copy

    def scratch_blocks(self) -> list[Block]:
        blocks = [*self.forks.values(), *([self.scratch] if self.scratch is not None else [])]
        self.forks, self.scratch = {}, None
        return [b for b in blocks if not b.freed]


def outcome_of(exc: BaseException) -> str:
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
