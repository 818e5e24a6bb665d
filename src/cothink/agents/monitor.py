"""Monitor: watch an endless stream of observations and raise a finding when a probe crosses a threshold.

Coroutines (engine names ``<name>.watcher`` / ``<name>.thinker``):

- **watcher** (interactive): appends each observation to a bounded :class:`ObservationWindow` (old
  observations leave memory as the stream grows), and every ``check_every`` observations probes
  ``[ctx, *window(, notes)]`` with the anomaly question. When P(yes) >= ``threshold`` it classifies the
  anomaly with a second probe whose choices are ``kinds`` and raises a :class:`Finding` (type, evidence:
  the last observations, time, probability).
- **thinker** (optional, ``think_tokens > 0``; background): keeps writing notes about the stream in its own
  bounded block, reading the window live; the watcher's probes read the notes too.
- ``mode="sequential"`` (baseline): no background thinker; after each check-worthy observation the
  watcher writes ``think_tokens`` of reasoning before probing (turn-based reasoning per observation;
  with ``check_every=1`` it reasons over every observation in turn, counted in
  ``MonitorResult.reasoned``).

``focus`` (optional) is added to the task: the paper reports that without a focus prompt the model
overthinks. The stream is any async iterator of strings; ``stop_on_finding`` ends the run at the first
finding.

Intake: by default the watcher pulls one observation at a time, so a source that can wait is never
dropped from (back-pressure). A live source cannot wait: with ``max_pending=N`` an intake task reads
it eagerly into a queue of at most N observations and, under a storm, drops the oldest (counted in
``MonitorResult.observations_dropped``, as "dropped" events and in the Prometheus counter
``cothink_stream_events_dropped_total{agent="<name>"}``), as the StreamAgent's coordinator does.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from cothink.agents.base import Agent, AgentEvent, BackgroundThinker, ObservationWindow, stop_background
from cothink.observability.metrics import count_dropped_events


@dataclass(frozen=True)
class Finding:
    type: str
    evidence: list[str]  # the last observations in the window when it was raised
    time: float  # seconds since run() began
    observation: int  # index of the observation that triggered it
    probability: float  # P(anomaly)
    type_probability: float


@dataclass
class MonitorResult:
    findings: list[Finding]
    observations: int
    checks: int
    dropped_chunks: int  # window chunks that left memory
    events: list[AgentEvent] = field(default_factory=list)
    watcher_forward_passes: int = 0
    thinker_forward_passes: int = 0
    observations_dropped: int = 0  # dropped from a full intake queue (only with max_pending)
    reasoned: int = 0  # observations the watcher wrote reasoning about before its probe (sequential mode)


class Monitor(Agent):
    """Constructor: ``engine`` (running), ``task`` (what is watched), ``kinds`` (finding types, probe
    choices), ``focus`` (optional focus prompt), ``question`` (the anomaly probe), ``threshold``,
    ``check_every`` (observations between probes), ``window_tokens`` / ``chunk_tokens`` (memory bound),
    ``think_tokens`` (0: no thinker), ``mode`` ("async" | "sequential"), ``evidence`` (observations kept
    in a finding), ``stop_on_finding``, ``max_pending`` (None: pull one observation at a time; N: read
    eagerly into a queue of at most N, dropping the oldest), ``name``, ``on_event``."""

    def __init__(
        self,
        engine: Any,
        *,
        task: str,
        kinds: Sequence[str],
        focus: str | None = None,
        question: str = "Is something abnormal happening in the stream? Answer Yes or No.",
        threshold: float = 0.7,
        check_every: int = 1,
        window_tokens: int = 1024,
        chunk_tokens: int = 256,
        think_tokens: int = 0,
        mode: Literal["async", "sequential"] = "async",
        evidence: int = 5,
        stop_on_finding: bool = True,
        max_pending: int | None = None,
        system: str | None = None,
        name: str = "",
        on_event: Callable[[AgentEvent], None] | None = None,
        seed: int = 0,
    ):
        super().__init__(engine, name=name, on_event=on_event)
        if not kinds or len(set(kinds)) != len(kinds):
            raise ValueError("kinds must be distinct and non-empty")
        self.task = task
        self.kinds = tuple(kinds)
        self.focus = focus
        self.question = question
        self.threshold = threshold
        self.check_every = max(1, check_every)
        self.window_tokens = window_tokens
        self.chunk_tokens = chunk_tokens
        self.think_tokens = think_tokens
        self.mode = mode
        self.evidence = evidence
        self.stop_on_finding = stop_on_finding
        self.max_pending = None if max_pending is None else max(1, max_pending)
        self.observations_dropped = 0
        self.reasoned = 0
        self.system = system or "You watch a live stream of observations and report anomalies."
        self.seed = seed

    def _task_text(self) -> str:
        kinds = ", ".join(self.kinds)
        text = f"{self.task}\nPossible anomalies: {kinds}."
        return text + (f"\nFocus: {self.focus}" if self.focus else "")

    async def run(self, observations: AsyncIterable[str]) -> MonitorResult:
        engine = self.engine
        self._start_clock()
        watcher = self.coroutine("watcher")
        ctx, window = await self.open_context(
            self._task_text(), "watcher", "observations", chunk_tokens=self.chunk_tokens,
            max_tokens=self.window_tokens,
        )
        stop = asyncio.Event()
        thinker: BackgroundThinker | None = None
        thinker_task: asyncio.Task | None = None
        findings: list[Finding] = []
        checks = count = 0
        self.observations_dropped = 0
        self.reasoned = 0
        try:
            async with aclosing(self._intake(observations)) as intake:
                async for obs in intake:
                    await window.append(obs.rstrip("\n") + "\n", watcher)
                    self.emit("input", "watcher", obs)
                    count += 1
                    if thinker is None and self.mode == "async" and self.think_tokens > 0:
                        # started after the first observation: the window has a block to read
                        thinker = BackgroundThinker(
                            self,
                            "thinker",
                            [ctx],
                            window,
                            self.chat.question("Note briefly what you see in the stream."),
                            max_tokens=self.think_tokens,
                        )
                        thinker_task = asyncio.create_task(thinker.run(stop), name=self.coroutine("thinker"))
                    if count % self.check_every:
                        continue
                    checks += 1
                    view = [ctx, *window.blocks]
                    if thinker is not None and len(thinker.block):
                        view.append(thinker.block)
                    finding = await self._check(view, count - 1, window)
                    if finding is not None:
                        findings.append(finding)
                        if self.stop_on_finding:
                            break
        finally:
            stop.set()
            await stop_background(thinker_task)
            if thinker is not None:
                thinker.close()
            dropped = window.dropped_chunks
            window.close()
            engine.release(ctx)
        return MonitorResult(
            findings,
            count,
            checks,
            dropped,
            list(self.events),
            self.forward_passes("watcher"),
            self.forward_passes("thinker"),
            self.observations_dropped,
            self.reasoned,
        )

    async def _intake(self, observations: AsyncIterable[str]) -> AsyncIterator[str]:
        """The observations to watch: all of them, pulled one at a time (max_pending None), or read
        eagerly into a queue of at most max_pending from which the oldest are dropped."""
        if self.max_pending is None:
            async for obs in observations:
                yield obs
            return
        limit = self.max_pending
        pending: deque[str] = deque()
        arrived = asyncio.Event()

        async def read() -> None:
            try:
                async for obs in observations:
                    pending.append(obs)
                    while len(pending) > limit:
                        stale = pending.popleft()
                        self.observations_dropped += 1
                        count_dropped_events(self.name)  # cothink_stream_events_dropped_total
                        self.emit("dropped", "watcher", stale)
                    arrived.set()
            finally:
                arrived.set()

        reader = asyncio.create_task(read(), name=self.coroutine("intake"))
        try:
            while True:
                if pending:
                    yield pending.popleft()
                    continue
                if reader.done():
                    reader.result()  # the source's error, if it failed
                    return
                arrived.clear()
                await arrived.wait()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _check(self, view: list[Any], index: int, window: ObservationWindow) -> Finding | None:
        engine, watcher = self.engine, self.coroutine("watcher")
        scratch = None
        try:
            if self.mode == "sequential" and self.think_tokens > 0:
                scratch = engine.block(f"{watcher}-think-{index}")
                view = [*view, scratch]
                await engine.extend(
                    scratch,
                    self.chat.question("Think briefly about the stream so far."),
                    view=view,
                    name=watcher,
                    priority="interactive",
                )
                res = await engine.generate(
                    view, max_tokens=self.think_tokens, name=watcher, priority="interactive", seed=self.seed
                ).collect()
                self.reasoned += 1
                self.emit("thought", "watcher", res.text.strip(), tokens=len(res.token_ids))
            p = await self.probe_yes(view, self.question, "watcher")
            self.emit("probe", "watcher", self.question, value=p)
            if p < self.threshold:
                return None
            probs = await engine.probe(
                view,
                self.chat.question(f"Which anomaly is it? One of: {', '.join(self.kinds)}."),
                choices=self.kinds,
                name=watcher,
                priority="interactive",
            )
            kind = max(probs, key=probs.get)
            finding = Finding(
                kind, window.texts(self.evidence), round(self.elapsed(), 4), index, p, probs[kind]
            )
            self.emit("finding", "watcher", kind, value=p)
            return finding
        finally:
            if scratch is not None:
                engine.release(scratch)
