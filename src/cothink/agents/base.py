"""What every agent pattern shares: typed events, coroutine names, a bounded observation window and a
background thinker. Public Engine API only (block / extend / generate / probe / release / stats)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from cothink.agents.chat import ChatFormat

EventKind = Literal["input", "thought", "probe", "said", "plan", "action", "finding", "dropped", "event"]


@dataclass(frozen=True)
class AgentEvent:
    """One thing an agent did: what (kind, text), when (seconds since run() began), which coroutine, and
    that coroutine's forward passes so far (``engine.stats[coroutine].forward_passes``)."""

    kind: EventKind
    coroutine: str
    time: float
    text: str = ""
    value: float | None = None  # a probe's probability, a reward
    forward_passes: int = 0
    tokens: int = 0  # tokens generated for this event (said, thought, plan)


class Agent:
    """Base of the patterns: an engine, a name prefix for coroutines, an event log and an optional
    ``on_event`` callback (called synchronously for each event, in order)."""

    system = ""  # the system prompt a pattern's context starts with (set by each pattern)

    def __init__(self, engine: Any, *, name: str = "", on_event: Callable[[AgentEvent], None] | None = None):
        if engine.tokenizer is None:
            raise ValueError("agents need a model with a tokenizer")
        self.engine = engine
        self.name = name
        self.on_event = on_event
        self.chat = ChatFormat(engine.tokenizer)
        self.events: list[AgentEvent] = []
        self._t0 = time.perf_counter()

    def coroutine(self, role: str) -> str:
        """The engine name of one of this agent's coroutines (``engine.stats`` key)."""
        return f"{self.name}.{role}" if self.name else role

    def forward_passes(self, role: str) -> int:
        stats = self.engine.stats.get(self.coroutine(role))
        return stats.forward_passes if stats is not None else 0

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def _start_clock(self) -> None:
        self._t0 = time.perf_counter()

    def emit(
        self, kind: EventKind, role: str, text: str = "", value: float | None = None, tokens: int = 0
    ) -> AgentEvent:
        event = AgentEvent(
            kind,
            self.coroutine(role),
            round(self.elapsed(), 4),
            text,
            value,
            self.forward_passes(role),
            tokens,
        )
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        return event

    def of_kind(self, kind: EventKind) -> list[AgentEvent]:
        return [e for e in self.events if e.kind == kind]

    async def open_context(
        self, task: str, role: str, window: str, *, chunk_tokens: int, max_tokens: int
    ) -> tuple[Any, ObservationWindow]:
        """What every pattern starts from: a context block holding the system prompt and the task
        (through the chat template, prefilled by coroutine `role`), and the bounded window its
        observations go into."""
        ctx = self.engine.block(self.coroutine("ctx"))
        turns = [{"role": "system", "content": self.system}, {"role": "user", "content": task}]
        await self.engine.extend(
            ctx, self.chat.conversation(turns), name=self.coroutine(role), priority="interactive"
        )
        observations = ObservationWindow(
            self.engine, self.coroutine(window), chunk_tokens=chunk_tokens, max_tokens=max_tokens
        )
        return ctx, observations

    async def probe_yes(
        self,
        view: list[Any],
        question: str,
        role: str,
        choices: tuple[str, str] = ("Yes", "No"),
        priority: str = "interactive",
    ) -> float:
        """P(first choice) after a user question closing the current turn (through the chat template)."""
        text = self.chat.question(question)
        p = await self.engine.probe(view, text, choices=choices, name=self.coroutine(role), priority=priority)
        return float(p[choices[0]])

    async def say(
        self,
        view: list[Any],
        instruction: str,
        role: str,
        *,
        max_tokens: int,
        prefix: str = "",
        stop: tuple[str, ...] = ("\n",),
        priority: str = "interactive",
        seed: int = 0,
    ) -> tuple[str, int]:
        """Generate a short utterance in a scratch block after `view` (the scratch block is released):
        returns (text, tokens generated). Nothing in the view is re-encoded."""
        scratch = self.engine.block(f"{self.coroutine(role)}-scratch")
        try:
            await self.engine.extend(
                scratch,
                self.chat.question(instruction) + prefix,
                view=[*view, scratch],
                name=self.coroutine(role),
                priority=priority,
            )
            res = await self.engine.generate(
                [*view, scratch],
                max_tokens=max_tokens,
                stop=list(stop),
                name=self.coroutine(role),
                priority=priority,
                seed=seed,
            ).collect()
            return (prefix + res.text).strip(), len(res.token_ids)
        finally:
            self.engine.release(scratch)


class DeferredRelease:
    """Blocks leaving a view that a reader may still hold: released at once when no reader holds the view,
    else when the last reader lets go. A reader that awaits between taking a view and submitting its work
    needs the view's blocks alive; work already submitted keeps its blocks alive by itself."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.readers = 0
        self._retired: list[Any] = []  # dropped while a reader held the view

    @contextmanager
    def held(self) -> Iterator[None]:
        """One reader holds the view for the block's duration."""
        self.readers += 1
        try:
            yield
        finally:
            self.readers -= 1
            if not self.readers:
                self.flush()

    def drop(self, block: Any) -> None:
        """`block` left the view: release it now, or when the last reader lets go."""
        if self.readers:
            self._retired.append(block)
        else:
            self.engine.release(block)

    def flush(self) -> None:
        """Release every dropped block now (the view is closing, or no reader holds it)."""
        for block in self._retired:
            self.engine.release(block)
        self._retired.clear()


async def stop_background(task: asyncio.Task[Any] | None, timeout: float = 60.0) -> None:
    """Wait for a background coroutine that was told to stop (it finishes its current piece); cancel it
    when it has not finished within `timeout` seconds."""
    if task is None:
        return
    try:
        await asyncio.wait_for(task, timeout=timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        task.cancel()


@dataclass
class _Chunk:
    block: Any
    texts: list[str] = field(default_factory=list)


class ObservationWindow:
    """A bounded window of observations in a few blocks: appended to the newest chunk; a full chunk
    (``chunk_tokens``) starts a new block; when the window holds more than ``max_tokens`` the oldest
    chunk leaves memory (released). Readers take ``blocks`` at the moment they start a forward pass."""

    def __init__(self, engine: Any, name: str, *, chunk_tokens: int = 256, max_tokens: int = 1024):
        if chunk_tokens < 1 or max_tokens < chunk_tokens:
            raise ValueError("need 1 <= chunk_tokens <= max_tokens")
        self.engine = engine
        self.name = name
        self.chunk_tokens = chunk_tokens
        self.max_tokens = max_tokens
        self._chunks: list[_Chunk] = []
        self._count = 0
        self.version = 0  # bumps when the list of blocks changes (readers rebuild their views)
        self.dropped_chunks = 0
        self.appended = 0
        self._release = DeferredRelease(engine)  # chunks dropped while pinned

    @contextmanager
    def pinned(self) -> Iterator[list[Any]]:
        """The current blocks, kept alive until the block exits (see `DeferredRelease`)."""
        with self._release.held():
            yield self.blocks

    @property
    def blocks(self) -> list[Any]:
        return [c.block for c in self._chunks]

    @property
    def tokens(self) -> int:
        return sum(len(c.block) for c in self._chunks)

    def texts(self, last: int | None = None) -> list[str]:
        out = [t for c in self._chunks for t in c.texts]
        return out if last is None else out[-last:]

    async def append(self, text: str, coroutine: str, priority: str = "interactive") -> None:
        if not self._chunks or len(self._chunks[-1].block) >= self.chunk_tokens:
            self._chunks.append(_Chunk(self.engine.block(f"{self.name}-{self._count}")))
            self._count += 1
            self.version += 1
        chunk = self._chunks[-1]
        await self.engine.extend(chunk.block, text, name=coroutine, priority=priority)
        chunk.texts.append(text)
        self.appended += 1
        while len(self._chunks) > 1 and self.tokens > self.max_tokens:
            self._release.drop(self._chunks.pop(0).block)
            self.dropped_chunks += 1
            self.version += 1

    def close(self) -> None:
        for c in self._chunks:
            self.engine.release(c.block)
        self._chunks.clear()
        self._release.flush()


class BackgroundThinker:
    """A coroutine that keeps generating notes into its own block while reading ``[*head, *window, notes]``.

    When the window's blocks change (a chunk added or dropped) the generation is restarted over the new
    view; the notes block keeps what it wrote (nothing is re-encoded). When the notes exceed
    ``max_tokens`` they are cut back to the prompt (a bounded scratchpad). Each completed line is an
    event ("thought").
    """

    def __init__(
        self,
        agent: Agent,
        role: str,
        head: list[Any],
        window: ObservationWindow,
        prompt: str,
        *,
        max_tokens: int = 256,
        chunk_tokens: int = 32,
        priority: str = "background",
    ):
        self.agent = agent
        self.role = role
        self.head = head
        self.window = window
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.chunk_tokens = chunk_tokens
        self.priority = priority
        self.block = agent.engine.block(agent.coroutine(role))
        self.generated = 0
        self._line = ""
        self._prompt_len = 0

    @property
    def view(self) -> list[Any]:
        return [*self.head, *self.window.blocks, self.block]

    async def run(self, stop: asyncio.Event) -> None:
        engine, name = self.agent.engine, self.agent.coroutine(self.role)
        await engine.extend(self.block, self.prompt, view=self.view, name=name, priority=self.priority)
        self._prompt_len = len(self.block)
        while not stop.is_set():
            if len(self.block) - self._prompt_len >= self.max_tokens:
                engine.truncate(self.block, self._prompt_len)
            version = self.window.version
            gen = engine.generate(
                self.view, max_tokens=self.chunk_tokens, name=name, priority=self.priority, stop_at_eos=False
            )
            async for piece in gen:
                self.generated += len(piece.token_ids)
                self._feed(piece.text, len(piece.token_ids))
                if stop.is_set() or self.window.version != version:
                    gen.cancel()
                    break
            await asyncio.sleep(0)

    def _feed(self, text: str, n: int) -> None:
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            if line.strip():
                self.agent.emit("thought", self.role, line.strip(), tokens=n)

    def close(self) -> None:
        self.agent.engine.release(self.block)
