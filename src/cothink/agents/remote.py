"""Run the agent patterns against a cothink server: the subset of the Engine API the patterns use, over
the HTTP session API (``cothink.client.AsyncSession``).

``RemoteEngine(session, tokenizer)`` offers ``block``, ``extend``, ``generate`` (a generation to iterate
for pieces, ``collect()`` or ``cancel()``), ``probe``, ``truncate`` and ``release`` with the Engine's
signatures. Blocks are created on the server when first used; inputs are tokenized here with the model's
tokenizer (the same one the server uses) and sent as token ids, so each block's tokens and length are
known locally without asking the server. Calls that are synchronous on the Engine (``block``,
``truncate``, ``release``) are queued per block and complete before that block's next operation.

Not available over HTTP: per-coroutine forward passes (``stats`` is empty, so events report 0) and
``memory()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cothink.client import AsyncSession


class RemoteBlock:
    """A block of a server session, as the agents see it (``len(block)``, ``block.tokens``)."""

    def __init__(self, name: str | None):
        self.name = name or "block"
        self.id: str | None = None
        self.tokens: list[int] = []
        self._pending: asyncio.Task | None = None  # creation / truncation / deletion in flight
        self.freed = False

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"RemoteBlock({self.name!r}, id={self.id!r}, length={len(self)})"


class RemoteGeneration:
    """A generation on the server: ``async for piece in gen``, ``await gen.collect()``, ``gen.cancel()``."""

    def __init__(self, engine: RemoteEngine, view: list[RemoteBlock], params: dict[str, Any]):
        self.engine = engine
        self.view = view
        self.params = params
        self.result: Any = None
        self.coroutine: str | None = None
        self._cancelled = False
        self._started = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        from cothink import GenerationResult, Piece

        if self._started:
            raise RuntimeError("a generation is iterated once")
        self._started = True
        engine, block = self.engine, self.view[-1]
        await engine._ready(self.view)
        start = len(block.tokens)
        texts: list[str] = []
        try:
            async for event in engine.session.stream([b.id for b in self.view], **self.params):
                kind = event.get("type")
                if kind == "start":
                    self.coroutine = event.get("coroutine")
                    if self._cancelled:
                        await engine.session.cancel(self.coroutine)
                elif kind == "token":
                    ids = list(event.get("token_ids") or [])
                    block.tokens.extend(ids)
                    texts.append(event.get("text", ""))
                    if event.get("text") or ids:
                        yield Piece(event.get("text", ""), ids)
                elif kind == "end":
                    block.tokens[start:] = list(event.get("token_ids") or [])
                    self.result = GenerationResult(
                        event.get("text", ""),
                        list(event.get("token_ids") or []),
                        event.get("finish_reason", "stop"),
                    )
                elif kind == "error":
                    raise RuntimeError(f"server error in generation: {event.get('message', event)}")
        finally:
            if self.result is None:
                # stopped early (cancelled or the consumer left): the server keeps what was written
                self._cancelled = True
                if self.coroutine is not None:
                    block._pending = asyncio.ensure_future(self._stop_and_sync(block))
                self.result = GenerationResult("".join(texts), block.tokens[start:], "cancelled")

    async def _stop_and_sync(self, block: RemoteBlock) -> None:
        session = self.engine.session
        try:
            await session.cancel(self.coroutine)  # type: ignore[arg-type]
        except Exception:  # already finished on the server: nothing to cancel
            pass
        ref = await session.get_block(block.id, token_ids=True)  # type: ignore[arg-type]
        block.tokens = list(ref.token_ids or [])

    async def collect(self) -> Any:
        async for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        """Stop the generation (what it wrote stays in the block)."""
        self._cancelled = True
        if self.coroutine is not None and self.result is None:
            block = self.view[-1]
            block._pending = asyncio.ensure_future(self._stop_and_sync(block))


class RemoteEngine:
    """The Engine calls the agent patterns use, over a server session. ``tokenizer``: the served model's."""

    def __init__(self, session: AsyncSession, tokenizer: Any):
        self.session = session
        self.tokenizer = tokenizer
        self.stats: dict[str, Any] = {}  # forward passes are not reported over HTTP

    def block(self, name: str | None = None) -> RemoteBlock:
        block = RemoteBlock(name)

        async def create() -> None:
            ref = await self.session.block(name=block.name[:64])
            block.id = ref.id

        block._pending = asyncio.ensure_future(create())
        return block

    async def _ready(self, blocks: Sequence[RemoteBlock]) -> None:
        for b in blocks:
            if b.freed:
                from cothink.errors import BlockFreedError

                raise BlockFreedError(f"block {b.name!r} was released")
            while b._pending is not None:
                task = b._pending
                await task
                if b._pending is task:
                    b._pending = None

    def _ids(self, text: str | None, token_ids: list[int] | None) -> list[int]:
        if token_ids is not None:
            return list(token_ids)
        return list(self.tokenizer.encode(text or "", add_special_tokens=False))

    async def extend(
        self,
        block: RemoteBlock,
        text: str | None = None,
        token_ids: list[int] | None = None,
        view: list[RemoteBlock] | None = None,
        *,
        priority: Any = None,
        name: str | None = None,
    ) -> None:
        view = view if view is not None else [block]
        await self._ready(view)
        ids = self._ids(text, token_ids)
        await self.session.extend(
            block.id,
            token_ids=ids,
            view=[b.id for b in view],  # type: ignore[misc]
            priority=_priority(priority),
        )
        block.tokens.extend(ids)

    def generate(
        self,
        view: list[RemoteBlock] | RemoteBlock,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        priority: Any = None,
        name: str | None = None,
        stop_at_eos: bool = True,
    ) -> RemoteGeneration:
        view = [view] if isinstance(view, RemoteBlock) else list(view)
        params: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            priority=_priority(priority),
            name=(name or None) and name[:64],
        )
        if not stop_at_eos:
            params["stop_at_eos"] = False
        return RemoteGeneration(self, view, params)

    async def probe(
        self,
        view: list[RemoteBlock] | RemoteBlock,
        question: str | list[int],
        choices: Sequence[str] = ("yes", "no"),
        *,
        priority: Any = None,
        name: str | None = None,
    ) -> dict[str, float]:
        view = [view] if isinstance(view, RemoteBlock) else list(view)
        await self._ready(view)
        return await self.session.probe(
            [b.id for b in view],
            question,
            choices=list(choices),  # type: ignore[misc]
            priority=_priority(priority) or "interactive",
        )

    def truncate(self, block: RemoteBlock, n: int) -> None:
        previous = block._pending

        async def cut() -> None:
            if previous is not None:
                await previous
            await self.session.truncate(block.id, n)  # type: ignore[arg-type]

        block.tokens = block.tokens[:n]
        block._pending = asyncio.ensure_future(cut())

    def release(self, block: RemoteBlock) -> None:
        previous = block._pending

        async def delete() -> None:
            if previous is not None:
                await previous
            await self.session.delete_block(block.id)  # type: ignore[arg-type]

        block.freed = True
        block._pending = asyncio.ensure_future(delete())

    async def drain(self, blocks: Sequence[RemoteBlock]) -> None:
        """Wait for queued creations, truncations and deletions of `blocks`."""
        for b in blocks:
            if b._pending is not None:
                await b._pending


def _priority(priority: Any) -> str | None:
    if priority is None:
        return None
    if isinstance(priority, str):
        return priority
    cls = getattr(priority, "cls", None) or getattr(priority, "priority_class", None)
    return getattr(cls, "value", None) or str(priority)
