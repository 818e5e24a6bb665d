"""A synchronous facade over Engine for scripts and notebooks: one event loop in a daemon thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cothink.errors import EngineClosedError
from cothink.memory.block import Block
from cothink.runtime.engine import Engine
from cothink.runtime.engine import GenerationResult, Piece


class SyncEngine:
    """Same operations as Engine, blocking. Use as a context manager or call close()."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cothink-sync", daemon=True)
        self._closed = False
        self._thread.start()
        self._call(engine.start())

    @classmethod
    def from_pretrained(
        cls, path_or_name: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, **limits: Any
    ) -> SyncEngine:
        return cls(Engine.from_pretrained(path_or_name, device, dtype, **limits))

    def _call(self, coro):
        if self._closed:
            coro.close()
            raise EngineClosedError("the engine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:  # wake up now and then: a call must not outlive close()
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if not self._loop.is_running():
                    raise EngineClosedError("the engine was closed during the call") from None

    def _run(self, fn, *args, **kwargs):
        async def call():
            return fn(*args, **kwargs)

        return self._call(call())

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def block(self, name: str | None = None) -> Block:
        return self._run(self.engine.block, name)

    def fork(self, block: Block, name: str | None = None) -> Block:
        return self._run(self.engine.fork, block, name)

    def truncate(self, block: Block, n: int) -> None:
        self._run(self.engine.truncate, block, n)

    def release(self, block: Block) -> None:
        self._run(self.engine.release, block)

    def extend(
        self, block: Block, text: str | None = None, token_ids: list[int] | None = None, **kw: Any
    ) -> None:
        self._call(self.engine.extend(block, text, token_ids, **kw))

    def probe(
        self, view: list[Block] | Block, question: str, choices=("yes", "no"), **kw: Any
    ) -> dict[str, float]:
        return self._call(self.engine.probe(view, question, choices, **kw))

    def generate(self, view: list[Block] | Block, **kw: Any) -> GenerationResult:
        """Run a generation to the end and return its result."""

        async def run():
            return await self.engine.generate(view, **kw).collect()

        return self._call(run())

    def stream(self, view: list[Block] | Block, **kw: Any) -> Iterator[Piece]:
        """Yield pieces as they are generated; closing the iterator early cancels the generation."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run():
            try:
                async for piece in self.engine.generate(view, **kw):
                    await queue.put(piece)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                await queue.put(exc)
            await queue.put(done)

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            while True:
                item = self._call(queue.get())
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def close(self) -> None:
        """Stop the engine (running generations end as 'cancelled') and the loop; later calls raise."""
        if self._closed:
            return
        asyncio.run_coroutine_threadsafe(self.engine.stop(), self._loop).result(timeout=60)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
