"""The generic layout runner: executes any valid layout on a running engine (public Engine API only).

Blocks are created from the layout (``context`` blocks get the chat conversation [system, task]; a
``scratch`` block gets its writer's prompt as a user question through the chat template). Triggers fire
runs:

- ``start``: once, at the beginning; ``timer``: every ``seconds``;
- ``event``: each input event, after the rules appended it (a rule coroutine appends every event to its
  block, dropping the oldest waiting events beyond ``max_pending``);
- ``every_tokens``: every ``tokens`` tokens the named generate coroutine writes;
- ``probe``: when the named probe gives ``choice`` a probability >= ``threshold``;
- ``done``: when a run of the named coroutine ends.

A coroutine runs one run at a time; a trigger that fires while it runs is remembered once (coalesced) and
starts the next run. ``stop.min_gap_s`` delays a run, ``stop.max_runs`` ends the coroutine, ``repeat``
restarts a generate coroutine when a run ends. The run ends when the input is exhausted and every
coroutine is idle (or ``max_seconds`` passed). Every run emits typed :class:`AgentEvent` records
(``said`` for a generate's text, ``probe`` with the chosen choice's probability, ``event``/``dropped`` for
rules); coroutines marked ``output`` are the layout's outputs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

from cothink.agents.base import Agent, AgentEvent
from cothink.errors import CothinkError
from cothink.layouts.model import (
    CoroutineSpec,
    DoneTrigger,
    EventTrigger,
    EveryTokensTrigger,
    Layout,
    ProbeTrigger,
    StartTrigger,
    TimerTrigger,
)
from cothink.layouts.validate import validate


class InvalidLayoutError(CothinkError, ValueError):
    """A layout that does not pass validation."""


@dataclass(frozen=True)
class LayoutOutput:
    coroutine: str
    text: str
    time: float
    value: float | None = None  # probe: probability of the chosen choice


@dataclass
class LayoutRun:
    layout: str
    outputs: list[LayoutOutput]
    runs: dict[str, int]  # coroutine -> runs
    forward_passes: dict[str, int]
    events: list[AgentEvent] = field(default_factory=list)
    events_in: int = 0
    events_dropped: int = 0


@dataclass
class _State:
    spec: CoroutineSpec
    runs: int = 0
    running: bool = False
    pending: bool = False
    tokens: int = 0  # generated so far (every_tokens triggers)
    last_end: float = -1e9
    prompt_len: int = 0


class LayoutRunner(Agent):
    """``LayoutRunner(engine, layout, name="", on_event=None, seed=0)``;
    ``await runner.run(events, max_seconds=60)`` -> :class:`LayoutRun`."""

    def __init__(
        self,
        engine: Any,
        layout: Layout,
        *,
        name: str = "",
        on_event: Callable[[AgentEvent], None] | None = None,
        seed: int = 0,
    ):
        issues = validate(layout)
        if issues:
            raise InvalidLayoutError("; ".join(str(i) for i in issues))
        super().__init__(engine, name=name, on_event=on_event)
        self.layout = layout
        self.seed = seed
        self._states = {c.name: _State(c) for c in layout.coroutines}
        self._blocks: dict[str, Any] = {}
        self._outputs: list[LayoutOutput] = []
        self._tasks: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._queue: deque[str] = deque()
        self._events_in = 0
        self._dropped = 0
        self._closing = False

    # ---- triggers ------------------------------------------------------------------------------
    def _listeners(self, pred: Callable[[Any], bool]) -> list[str]:
        return [
            c.name for c in self.layout.coroutines if c.role != "rule" and any(pred(t) for t in c.triggers)
        ]

    def fire(self, name: str) -> None:
        st = self._states[name]
        if self._closing or (st.spec.stop.max_runs is not None and st.runs >= st.spec.stop.max_runs):
            return
        if st.running:
            st.pending = True
            return
        st.running = True
        self._idle.clear()
        task = asyncio.create_task(self._run_one(st), name=self.coroutine(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_one(self, st: _State) -> None:
        spec = st.spec
        try:
            while True:
                wait = st.last_end + spec.stop.min_gap_s - self.elapsed()
                if wait > 0:
                    await asyncio.sleep(wait)
                st.runs += 1
                if spec.role == "generate":
                    await self._generate(st)
                elif spec.role == "probe":
                    await self._probe(st)
                st.last_end = self.elapsed()
                for other in self._listeners(
                    lambda t: isinstance(t, DoneTrigger) and t.coroutine == spec.name
                ):
                    self.fire(other)
                again = st.pending or (spec.repeat and not self._closing)
                st.pending = False
                if (
                    not again
                    or self._closing
                    or (spec.stop.max_runs is not None and st.runs >= spec.stop.max_runs)
                ):
                    return
        finally:
            st.running = False
            if not any(s.running for s in self._states.values()):
                self._idle.set()

    async def _generate(self, st: _State) -> None:
        spec, engine = st.spec, self.engine
        name = self.coroutine(spec.name)
        block = self._blocks[spec.writes]  # type: ignore[index]
        bound = next(b.max_tokens for b in self.layout.blocks if b.name == spec.writes)
        if bound is not None and len(block) - st.prompt_len >= bound:
            engine.truncate(block, st.prompt_len)
        view = [self._blocks[b] for b in spec.reads]
        every = [
            (o, t.tokens)
            for o in self.layout.coroutines
            for t in o.triggers
            if isinstance(t, EveryTokensTrigger) and t.coroutine == spec.name
        ]
        gen = engine.generate(
            view,
            max_tokens=spec.stop.max_tokens,
            stop=spec.stop.stop or None,
            name=name,
            priority=_priority(spec),
            seed=self.seed,
        )
        text = ""
        async for piece in gen:
            before = st.tokens
            st.tokens += len(piece.token_ids)
            text += piece.text
            for other, n in every:
                if st.tokens // n > before // n:
                    self.fire(other.name)
            if self._closing:
                gen.cancel()
                break
        tokens = len(gen.result.token_ids) if gen.result is not None else 0
        self.emit("said", spec.name, text.strip(), tokens=tokens)
        if spec.output and text.strip():
            self._outputs.append(LayoutOutput(spec.name, text.strip(), round(self.elapsed(), 4)))

    async def _probe(self, st: _State) -> None:
        spec = st.spec
        view = [self._blocks[b] for b in spec.reads]
        probs = await self.engine.probe(
            view,
            self.chat.question(spec.prompt),
            choices=tuple(spec.choices),
            name=self.coroutine(spec.name),
            priority=_priority(spec),
        )
        best = max(probs, key=probs.get)
        self.emit("probe", spec.name, best, value=probs[best])
        if spec.output:
            self._outputs.append(LayoutOutput(spec.name, best, round(self.elapsed(), 4), probs[best]))
        for other in self.layout.coroutines:
            for t in other.triggers:
                if isinstance(t, ProbeTrigger) and t.probe == spec.name and probs[t.choice] >= t.threshold:
                    self.fire(other.name)

    # ---- events (rules) --------------------------------------------------------------------------
    async def _deliver(self, text: str, index: int) -> None:
        for c in self.layout.coroutines:
            if c.role == "rule" and any(isinstance(t, EventTrigger) for t in c.triggers):
                block = self._blocks[c.writes]  # type: ignore[index]
                kind = next(b.kind for b in self.layout.blocks if b.name == c.writes)
                line = self.chat.user_turn(text) if kind == "context" else f"[{index}] {text}\n"
                await self.engine.extend(block, line, name=self.coroutine(c.name), priority="interactive")
                self.emit("event", c.name, text)
        for other in self._listeners(lambda t: isinstance(t, EventTrigger)):
            self.fire(other)

    def _has_future_work(self) -> bool:
        for s in self._states.values():
            if s.running and not s.spec.repeat:
                return True
            timed = any(isinstance(t, TimerTrigger) for t in s.spec.triggers)
            if timed and (s.spec.stop.max_runs is None or s.runs < s.spec.stop.max_runs):
                return True
        return False

    def _max_pending(self) -> int:
        rules = [c.max_pending for c in self.layout.coroutines if c.role == "rule"]
        return min(rules) if rules else 1 << 30

    # ---- run -------------------------------------------------------------------------------------
    async def run(self, events: AsyncIterable[str] | None = None, *, max_seconds: float = 60.0) -> LayoutRun:
        self._start_clock()
        await self._open_blocks()
        arrived, ended = asyncio.Event(), asyncio.Event()
        helpers = [asyncio.create_task(self._intake(events, arrived, ended), name=self.coroutine("intake"))]
        for c in self.layout.coroutines:
            for t in c.triggers:
                if isinstance(t, TimerTrigger):
                    helpers.append(asyncio.create_task(self._timer(c.name, t.seconds)))
        for name in self._listeners(lambda t: isinstance(t, StartTrigger)):
            self.fire(name)
        try:
            async with asyncio.timeout(max_seconds):
                await self._drive(arrived, ended)
        except TimeoutError:
            pass
        finally:
            await self._close(helpers)
        return self._result()

    async def _open_blocks(self) -> None:
        """The layout's blocks made; context blocks given the conversation, generators their prompts."""
        engine, lay = self.engine, self.layout
        for b in lay.blocks:
            self._blocks[b.name] = engine.block(self.coroutine(b.name))
        conversation = self.chat.conversation(
            [
                {"role": "system", "content": lay.system},
                {"role": "user", "content": lay.task or lay.description or "."},
            ]
        )
        for b in lay.blocks:
            if b.kind == "context":
                await engine.extend(
                    self._blocks[b.name], conversation, name=self.coroutine("layout"), priority="interactive"
                )
        for c in lay.coroutines:
            if c.role == "generate":
                block = self._blocks[c.writes]  # type: ignore[index]
                view = [self._blocks[r] for r in c.reads]
                prompt = self.chat.question(c.prompt) if c.prompt else self.chat.reopen()
                if any(len(v) for v in view[:-1]) or prompt:
                    await engine.extend(block, prompt, view=view, name=self.coroutine(c.name))
                self._states[c.name].prompt_len = len(block)

    async def _intake(
        self, events: AsyncIterable[str] | None, arrived: asyncio.Event, ended: asyncio.Event
    ) -> None:
        """Queue the input events as they come (the oldest dropped past the pending limit)."""
        try:
            if events is not None:
                async for ev in events:
                    self._queue.append(ev)
                    self._events_in += 1
                    while len(self._queue) > self._max_pending():
                        stale = self._queue.popleft()
                        self._dropped += 1
                        self.emit("dropped", "layout", stale)
                    arrived.set()
        finally:
            ended.set()
            arrived.set()

    async def _timer(self, name: str, seconds: float) -> None:
        while not self._closing:
            await asyncio.sleep(seconds)
            self.fire(name)

    async def _drive(self, arrived: asyncio.Event, ended: asyncio.Event) -> None:
        """Deliver the queued events in order until the input ends, then wait for the work they started."""
        index = 0
        while True:
            if self._queue:
                await self._deliver(self._queue.popleft(), index)
                index += 1
                continue
            if ended.is_set():
                break
            arrived.clear()
            await arrived.wait()
        # input exhausted: let the coroutines finish what the input started (repeat ones never do),
        # and timers run until their coroutines reach max_runs (without max_runs: until max_seconds)
        while self._has_future_work():
            await asyncio.sleep(0.01)

    async def _close(self, helpers: list[asyncio.Task]) -> None:
        """Stop the intake and timers, let the coroutines' tasks end, release the blocks."""
        self._closing = True
        for h in helpers:
            h.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=60)
        for block in self._blocks.values():
            self.engine.release(block)

    def _result(self) -> LayoutRun:
        lay = self.layout
        return LayoutRun(
            lay.name,
            list(self._outputs),
            {n: s.runs for n, s in self._states.items()},
            {c.name: self.forward_passes(c.name) for c in lay.coroutines},
            list(self.events),
            self._events_in,
            self._dropped,
        )

def _priority(spec: CoroutineSpec) -> Any:
    """The engine's priority (class and weight) for a coroutine spec."""
    from cothink import Priority, PriorityClass

    return Priority(PriorityClass[spec.priority.cls.upper()], weight=spec.priority.weight)
