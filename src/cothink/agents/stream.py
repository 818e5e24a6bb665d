"""Stream agent: the paper's five parts for commenting on a live stream of events.

- **coordinator** (no model calls): pulls events from the input (any async iterator; text now, frames
  once vision exists) into a bounded queue; under a storm (more than ``max_pending`` waiting) it drops the
  oldest, stale events ("dropped" events); it enforces timing: never speak within ``min_gap_s`` of the
  last utterance, and speak after ``max_silence_s`` of silence if anything new happened since;
- **event probe** (``<name>.event``): each incoming event is appended to the bounded observation window
  and a probe asks "did something new happen?" over ``[ctx, *window]``;
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
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

from cothink.agents.base import Agent, AgentEvent, BackgroundThinker


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

    async def run(self, events: AsyncIterable[str]) -> StreamResult:
        engine = self.engine
        self._start_clock()
        ctx, window = await self.open_context(
            self.task, "coordinator", "window", chunk_tokens=self.chunk_tokens, max_tokens=self.window_tokens
        )
        pending: deque[tuple[int, str]] = deque()
        arrived = asyncio.Event()
        ended = asyncio.Event()
        stop = asyncio.Event()
        state = {
            "seen": 0,
            "dropped": 0,
            "new": 0,
            "unsaid": 0,
            "last_said": time.perf_counter() - self.min_gap_s,
        }
        utterances: list[Utterance] = []
        thinker: BackgroundThinker | None = None
        thinker_task: asyncio.Task | None = None

        async def intake() -> None:  # coordinator: input -> bounded queue, dropping stale events
            try:
                async for ev in events:
                    pending.append((state["seen"], ev))
                    state["seen"] += 1
                    while len(pending) > self.max_pending:
                        index, stale = pending.popleft()
                        state["dropped"] += 1
                        self.emit("dropped", "coordinator", f"[{index}] {stale}")
                    arrived.set()
            finally:
                ended.set()
                arrived.set()

        async def speak(index: int, forced: bool) -> None:
            view = [ctx, *window.blocks, *([thinker.block] if thinker is not None else [])]
            text, n = await self.say(
                view,
                "In one short sentence, what is happening now?",
                "describer",
                max_tokens=self.describe_tokens,
                stop=("\n", "."),
                seed=self.seed,
            )
            utterances.append(Utterance(text, round(self.elapsed(), 4), index, forced, n))
            self.emit("said", "describer", text, tokens=n)
            state["last_said"] = time.perf_counter()
            state["unsaid"] = 0

        async def process() -> None:
            nonlocal thinker, thinker_task
            while True:
                if not pending:
                    if ended.is_set():
                        return
                    arrived.clear()
                    timeout = None
                    if state["unsaid"]:
                        timeout = max(0.0, state["last_said"] + self.max_silence_s - time.perf_counter())
                    try:
                        await asyncio.wait_for(arrived.wait(), timeout)
                    except asyncio.TimeoutError:
                        await speak(state["seen"] - 1, forced=True)  # too long silent with news unsaid
                    continue
                index, ev = pending.popleft()
                await window.append(f"[{index}] {ev}\n", self.coroutine("event"))
                self.emit("event", "event", ev)
                if thinker is None and self.think_tokens > 0:
                    thinker = BackgroundThinker(
                        self,
                        "thinker",
                        [ctx],
                        window,
                        self.chat.question("Note how the events connect."),
                        max_tokens=self.think_tokens,
                    )
                    thinker_task = asyncio.create_task(thinker.run(stop), name=self.coroutine("thinker"))
                p_new = await self.probe_yes(
                    [ctx, *window.blocks],
                    "Did something new happen in the last event? Answer Yes or No.",
                    "event",
                )
                self.emit("probe", "event", "new?", value=p_new)
                if p_new < self.event_threshold:
                    continue
                state["new"] += 1
                state["unsaid"] += 1
                since = time.perf_counter() - state["last_said"]
                if since < self.min_gap_s:
                    continue  # too soon after the last utterance: keep it for later
                if since >= self.max_silence_s:
                    await speak(index, forced=True)
                    continue
                view = [ctx, *window.blocks, *([thinker.block] if thinker is not None else [])]
                p_say = await self.probe_yes(
                    view, "Is there something worth saying now? Answer Yes or No.", "output"
                )
                self.emit("probe", "output", "say?", value=p_say)
                if p_say >= self.output_threshold:
                    await speak(index, forced=False)

        reader = asyncio.create_task(intake(), name=self.coroutine("coordinator"))
        try:
            await process()
        finally:
            stop.set()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if thinker_task is not None:
                try:
                    await asyncio.wait_for(thinker_task, timeout=60)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    thinker_task.cancel()
            if thinker is not None:
                thinker.close()
            window.close()
            engine.release(ctx)
        return StreamResult(
            utterances,
            state["seen"],
            state["dropped"],
            state["new"],
            list(self.events),
            {r: self.forward_passes(r) for r in self.ROLES},
        )
