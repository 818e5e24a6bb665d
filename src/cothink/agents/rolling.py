"""RollingContext: the recent part of an endless stream as a view with bounded memory and positions.

The stream is written into a chain of blocks of at most `block_tokens` tokens each. When the chain
holds more than `max_tokens` tokens (or `max_blocks` blocks) the oldest block leaves the view and is
released; with a `summarizer`, the blocks that leave are first folded into one short summary block
that stays at the front of the view. So the view's position span stays below
`max_tokens + block_tokens + summary tokens`, however long the stream runs, and so does its memory.

Uses only the public Engine API (docs/runtime.md): block, extend, seal, release.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cothink.agents.base import DeferredRelease

# (engine, [previous summary block or nothing, *blocks leaving the view]) -> the new summary
Summarizer = Callable[[Any, list[Any]], Awaitable[str | list[int]]]


@dataclass
class RollingStats:
    appended_tokens: int = 0
    blocks_made: int = 0
    blocks_dropped: int = 0
    summaries: int = 0


class RollingContext:
    """A bounded view over a growing stream.

    `append(text | token_ids)` writes into the newest block, read under the whole current view (the
    new input sees the summary and the recent stream); a full block is sealed (if `seal`, so a Gated
    DeltaNet model stops keeping its per-token records) and a new one started. `view` is the
    current [summary?, *blocks]. A reader that awaits between taking the view and submitting work
    takes it with `with ctx.reading() as view:` so no block in it is released meanwhile (work
    already submitted holds its blocks by itself).
    """

    def __init__(
        self,
        engine: Any,
        name: str = "stream",
        *,
        block_tokens: int = 256,
        max_tokens: int = 2048,
        max_blocks: int | None = None,
        summarizer: Summarizer | None = None,
        seal: bool = True,
        priority: str = "background",
    ):
        if block_tokens < 1 or max_tokens < block_tokens:
            raise ValueError("need 1 <= block_tokens <= max_tokens")
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.engine, self.name = engine, name
        self.block_tokens, self.max_tokens, self.max_blocks = block_tokens, max_tokens, max_blocks
        self.summarizer, self.seal, self.priority = summarizer, seal, priority
        self.blocks: list[Any] = []
        self.summary: Any | None = None
        self.stats = RollingStats()
        self._release = DeferredRelease(engine)  # blocks that left the view while a reader held it

    # ---- reading ----------------------------------------------------------------------------
    @property
    def view(self) -> list[Any]:
        return ([self.summary] if self.summary is not None else []) + list(self.blocks)

    @property
    def tokens(self) -> int:
        return sum(len(b) for b in self.blocks)

    @property
    def position_span(self) -> int:
        return sum(b.position_span for b in self.view)

    @contextmanager
    def reading(self) -> Iterator[list[Any]]:
        """The current view, its blocks kept alive until the block exits (see `DeferredRelease`)."""
        with self._release.held():
            yield self.view

    # ---- writing ----------------------------------------------------------------------------
    async def append(self, text: str | None = None, token_ids: list[int] | None = None) -> None:
        """Append stream input (split across blocks at `block_tokens`), then evict what is too old."""
        tokens = list(token_ids) if token_ids is not None else None
        if tokens is None:
            if text is None or self.engine.tokenizer is None:
                raise ValueError("give text (with a tokenizer) or token_ids")
            tokens = self.engine.tokenizer.encode(text, add_special_tokens=False)
        while tokens:
            block = self._writable()
            room = self.block_tokens - len(block)
            part, tokens = tokens[:room], tokens[room:]
            await self.engine.extend(
                block, token_ids=part, view=self.view, name=self.name, priority=self.priority
            )
            self.stats.appended_tokens += len(part)
            if len(block) >= self.block_tokens and self.seal:
                self.engine.seal(block)
        await self._evict()

    def _writable(self) -> Any:
        if not self.blocks or len(self.blocks[-1]) >= self.block_tokens:
            self.blocks.append(self.engine.block(f"{self.name}-{self.stats.blocks_made}"))
            self.stats.blocks_made += 1
        return self.blocks[-1]

    def _too_long(self) -> bool:
        if len(self.blocks) <= 1:
            return False
        over_blocks = self.max_blocks is not None and len(self.blocks) > self.max_blocks
        return over_blocks or self.tokens > self.max_tokens

    async def _evict(self) -> None:
        leaving = []
        while self._too_long():
            leaving.append(self.blocks.pop(0))
        if not leaving:
            return
        if self.summarizer is not None:
            await self._summarize(leaving)
        for block in leaving:
            self._drop(block)
        self.stats.blocks_dropped += len(leaving)

    async def _summarize(self, leaving: list[Any]) -> None:
        previous = [self.summary] if self.summary is not None else []
        summary = await self.summarizer(self.engine, previous + leaving)
        block = self.engine.block(f"{self.name}-summary-{self.stats.summaries}")
        if isinstance(summary, str):
            await self.engine.extend(block, summary, name=self.name, priority=self.priority)
        elif summary:
            await self.engine.extend(block, token_ids=list(summary), name=self.name, priority=self.priority)
        old, self.summary = self.summary, block
        if old is not None:
            self._drop(old)
        self.stats.summaries += 1

    def _drop(self, block: Any) -> None:
        self._release.drop(block)

    def close(self) -> None:
        """Release every block of the context."""
        for block in self.view:
            self._drop(block)
        self.blocks, self.summary = [], None
