"""Stream agent: the paper's five parts for commenting on a live stream of events.

- **coordinator** (no model calls): pulls events from the input (any async iterator of text events and
  `Frames`, pixel frame groups of a live video with their timestamps) into a bounded queue; under a
  storm (more than ``max_pending`` waiting) it drops the oldest, stale events ("dropped" events, also
  counted in the Prometheus counter ``cothink_stream_events_dropped_total{agent="<name>"}``); it
  enforces timing: never speak within ``min_gap_s`` of the last utterance, and speak after
  ``max_silence_s`` of silence if anything new happened since;
- **event probe** (``<name>.event``): each incoming event is appended to the bounded observation window
  (a text event as a line; a frame group after its index line, through ``engine.extend(frames=...,
  timestamp=...)``, which needs a multimodal model) and a probe asks "did something new happen?" over
  ``[ctx, *window]``; for a frame group whose predecessor is still in the window, it asks whether
  anything changed between the two (by their index lines);
- **thinker** (``<name>.thinker``, background): keeps writing notes that link events, reading the window
  live (a :class:`BackgroundThinker`);
- **output probe** (``<name>.output``): after a new event, "is there something worth saying now?" over
  ``[ctx, *window, notes]``;
- **describer** (``<name>.describer``): says one sentence, generated in a scratch block after
  ``[ctx, *window, notes]`` (nothing is re-encoded).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cothink.agents.base import (
    Agent,
    AgentEvent,
    BackgroundThinker,
    ObservationWindow,
    _Chunk,
    stop_background,
)
from cothink.observability.metrics import count_dropped_events


@dataclass(frozen=True)
class Frames:
    """One frame group of a live video stream, as an event: `frames` (one or two frames of one size:
    PIL images, HxWx3 uint8 arrays or file paths) at `timestamp` seconds from the stream's start;
    `label` (optional) is text written just before them (e.g. what the camera shows)."""

    frames: Sequence[Any]
    timestamp: float
    label: str = ""

    def __str__(self) -> str:
        said = f" {self.label}" if self.label else ""
        return f"{len(self.frames)} frame(s) at {self.timestamp:.1f} s{said}"


Event = str | Frames


class _StreamWindow(ObservationWindow):
    """The observation window, also holding frame groups (each with its index line in one chunk)."""

    async def append_frames(self, label: str, frames: Frames, coroutine: str,
                            priority: str = "interactive") -> None:
        if not self._chunks or len(self._chunks[-1].block) >= self.chunk_tokens:
            self._chunks.append(_Chunk(self.engine.block(f"{self.name}-{self._count}")))
            self._count += 1
            self.version += 1
        chunk = self._chunks[-1]
        await self.engine.extend(chunk.block, label, name=coroutine, priority=priority)
        await self.engine.extend(chunk.block, frames=frames.frames, timestamp=frames.timestamp,
                                 name=coroutine, priority=priority)
        await self.engine.extend(chunk.block, "\n", name=coroutine, priority=priority)
        chunk.texts.append(f"{label}{frames}\n")
        self.appended += 1
        while len(self._chunks) > 1 and self.tokens > self.max_tokens:
            self._release.drop(self._chunks.pop(0).block)
            self.dropped_chunks += 1
            self.version += 1


@dataclass(frozen=True)
class Utterance:
    text: str
    time: float  # seconds since run() began
    after_event: int  # index of the last event seen when it spoke
    forced: bool  # spoken because of max silence, not the output probe
    tokens: int


@dataclass
class StreamResult:
    utterances: list[Utterance]
    events_seen: int
    events_dropped: int
    new_events: int  # events the event probe judged new
    events: list[AgentEvent] = field(default_factory=list)
    forward_passes: dict[str, int] = field(default_factory=dict)  # per role


class StreamAgent(Agent):
    """Constructor: ``engine`` (running), ``task`` (what the stream is and what to comment on),
    ``event_threshold`` / ``output_threshold`` (probe thresholds), ``min_gap_s`` / ``max_silence_s``
    (coordinator timing), ``max_pending`` (queue bound before stale events are dropped),
    ``describe_tokens`` (most tokens per utterance), ``think_tokens`` (thinker notes bound; 0: no thinker),
    ``window_tokens`` / ``chunk_tokens`` (observation memory bound), ``name``, ``on_event``."""

    ROLES = ("coordinator", "event", "thinker", "output", "describer")

    def __init__(
        self,
        engine: Any,
        *,
        task: str,
        event_threshold: float = 0.5,
        output_threshold: float = 0.5,
        min_gap_s: float = 1.0,
        max_silence_s: float = 10.0,
        max_pending: int = 4,
        describe_tokens: int = 24,
        think_tokens: int = 64,
        window_tokens: int = 1024,
        chunk_tokens: int = 256,
        system: str | None = None,
        name: str = "",
        on_event: Callable[[AgentEvent], None] | None = None,
        seed: int = 0,
    ):
        super().__init__(engine, name=name, on_event=on_event)
        self.task = task
        self.event_threshold = event_threshold
        self.output_threshold = output_threshold
        self.min_gap_s = min_gap_s
        self.max_silence_s = max_silence_s
        self.max_pending = max(1, max_pending)
        self.describe_tokens = describe_tokens
        self.think_tokens = think_tokens
        self.window_tokens = window_tokens
        self.chunk_tokens = chunk_tokens
        self.system = system or "You comment on a live stream. Be brief and concrete."
        self.seed = seed

    async def run(self, events: AsyncIterable[Event]) -> StreamResult:
        """Comment on `events` (text events and `Frames`, in any mix) until the input ends."""
        self._start_clock()
        ctx, text_window = await self.open_context(
            self.task, "coordinator", "window", chunk_tokens=self.chunk_tokens, max_tokens=self.window_tokens
        )
        text_window.close()  # empty; the stream's window below also holds frame groups
        window = _StreamWindow(self.engine, self.coroutine("window"), chunk_tokens=self.chunk_tokens,
                               max_tokens=self.window_tokens)
        stream = _StreamRun(self, ctx, window)
        try:
            await stream.run(events)
        finally:
            await stream.close()
            window.close()
            self.engine.release(ctx)
        c = stream.counters
        return StreamResult(
            stream.utterances,
            c.seen,
            c.dropped,
            c.new,
            list(self.events),
            {r: self.forward_passes(r) for r in self.ROLES},
        )


@dataclass
class _Counters:
    seen: int = 0  # events read from the input
    dropped: int = 0  # stale events dropped from the queue
    new: int = 0  # events the event probe judged new
    unsaid: int = 0  # new events since the last utterance
    last_said: float = 0.0  # time.perf_counter() of the last utterance


class _StreamRun:
    """One `StreamAgent.run`: the coordinator's queue and timing, the probes and the speaker."""

    def __init__(self, agent: StreamAgent, ctx: Any, window: _StreamWindow):
        self.agent, self.ctx, self.window = agent, ctx, window
        self.pending: deque[tuple[int, Event]] = deque()
        self.arrived, self.ended, self.stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.counters = _Counters(last_said=time.perf_counter() - agent.min_gap_s)
        self.utterances: list[Utterance] = []
        self.thinker: BackgroundThinker | None = None
        self.thinker_task: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None
        self.last_frames: int | None = None  # the index of the last frame group in the window

    async def run(self, events: AsyncIterable[Event]) -> None:
        self.reader = asyncio.create_task(self.intake(events), name=self.agent.coroutine("coordinator"))
        await self.process()

    async def intake(self, events: AsyncIterable[Event]) -> None:
        """Coordinator: input -> bounded queue, dropping the oldest (stale) events under a storm."""
        agent, c = self.agent, self.counters
        try:
            async for ev in events:
                self.pending.append((c.seen, ev))
                c.seen += 1
                while len(self.pending) > agent.max_pending:
                    index, stale = self.pending.popleft()
                    c.dropped += 1
                    count_dropped_events(agent.name)  # cothink_stream_events_dropped_total
                    agent.emit("dropped", "coordinator", f"[{index}] {stale}")
                self.arrived.set()
        finally:
            self.ended.set()
            self.arrived.set()

    def view(self, notes: bool = True) -> list[Any]:
        tail = [self.thinker.block] if notes and self.thinker is not None else []
        return [self.ctx, *self.window.blocks, *tail]

    async def speak(self, index: int, forced: bool) -> None:
        agent = self.agent
        text, n = await agent.say(
            self.view(),
            "In one short sentence, what is happening now?",
            "describer",
            max_tokens=agent.describe_tokens,
            stop=("\n", "."),
            seed=agent.seed,
        )
        self.utterances.append(Utterance(text, round(agent.elapsed(), 4), index, forced, n))
        agent.emit("said", "describer", text, tokens=n)
        self.counters.last_said = time.perf_counter()
        self.counters.unsaid = 0

    async def next_event(self) -> tuple[int, Event] | None:
        """The next queued event; None when the input ended. Speaks if silent too long meanwhile."""
        c = self.counters
        while not self.pending:
            if self.ended.is_set():
                return None
            self.arrived.clear()
            timeout = None
            if c.unsaid:
                timeout = max(0.0, c.last_said + self.agent.max_silence_s - time.perf_counter())
            try:
                async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel (3.11)
                    await self.arrived.wait()
            except TimeoutError:
                await self.speak(c.seen - 1, forced=True)  # too long silent with news unsaid
        return self.pending.popleft()

    def start_thinker(self) -> None:
        agent = self.agent
        self.thinker = BackgroundThinker(
            agent,
            "thinker",
            [self.ctx],
            self.window,
            agent.chat.question("Note how the events connect."),
            max_tokens=agent.think_tokens,
        )
        self.thinker_task = asyncio.create_task(self.thinker.run(self.stop), name=agent.coroutine("thinker"))

    async def process(self) -> None:
        agent, c = self.agent, self.counters
        while (queued := await self.next_event()) is not None:
            index, ev = queued
            question = "Did something new happen in the last event? Answer Yes or No."
            if isinstance(ev, Frames):
                label = f"[{index}] {ev.label} " if ev.label else f"[{index}] "
                dropped = self.window.dropped_chunks
                await self.window.append_frames(label, ev, agent.coroutine("event"))
                if self.last_frames is not None and self.window.dropped_chunks == dropped:
                    # the previous frame group is still in the window: compare the two
                    question = (f"Compare frames [{index}] with frames [{self.last_frames}]. Did something "
                                "change? Answer Yes or No.")
                self.last_frames = index
            else:
                await self.window.append(f"[{index}] {ev}\n", agent.coroutine("event"))
            agent.emit("event", "event", str(ev))
            if self.thinker is None and agent.think_tokens > 0:
                self.start_thinker()
            p_new = await agent.probe_yes(self.view(notes=False), question, "event")
            agent.emit("probe", "event", "new?", value=p_new)
            if p_new < agent.event_threshold:
                continue
            c.new += 1
            c.unsaid += 1
            since = time.perf_counter() - c.last_said
            if since < agent.min_gap_s:
                continue  # too soon after the last utterance: keep it for later
            if since >= agent.max_silence_s:
                await self.speak(index, forced=True)
                continue
            p_say = await agent.probe_yes(
                self.view(), "Is there something worth saying now? Answer Yes or No.", "output"
            )
            agent.emit("probe", "output", "say?", value=p_say)
            if p_say >= agent.output_threshold:
                await self.speak(index, forced=False)

    async def close(self) -> None:
        """Stop the coordinator and the thinker (given a minute to finish its current note)."""
        self.stop.set()
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
        await stop_background(self.thinker_task)
        if self.thinker is not None:
            self.thinker.close()
