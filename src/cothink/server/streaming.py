"""Server-sent events that stop their generation as soon as the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cothink.server.errors import APIError, ClientGone

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(event: object) -> str:
    """One server-sent event carrying `event` as compact JSON (non-ASCII kept as is)."""
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_disconnect` when the client disconnects.

    Starlette cancels the streaming task on disconnect, but that cancellation can be starved: anyio only
    delivers it while the task waits on an unfinished future, and a generation completes its queue's
    future every engine step. So this response watches for the disconnect itself and ends the work at
    the source (`on_disconnect` cancels the generation, which then finishes at once); the body
    generator is closed at the end either way, so its `finally` (releasing blocks) runs right away.
    """

    media_type = "text/event-stream"

    def __init__(
        self, content, on_disconnect: Callable[[], None] | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})}, media_type=self.media_type)
        self.on_disconnect = on_disconnect
        self.disconnected = False

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                if self.on_disconnect is not None:
                    self.on_disconnect()
                return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        try:
            await self.stream_response(send)
        except OSError:  # the connection broke while writing
            if self.on_disconnect is not None:
                self.on_disconnect()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, callback: Callable[[], None]) -> AsyncIterator[None]:
    """Within the block, call `callback` (e.g. cancel a generation) if the client disconnects.

    For non-streaming responses, whose handlers Starlette lets run to the end after the client left.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                callback()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request) -> AsyncIterator[None]:
    """Within the block, cancel the current task if the client disconnects.

    For work a handler awaits before it can answer (a prefill of a long prompt, a tokenization): the
    cancellation reaches the awaited engine call, whose work then stops before its next step. The
    handler sees ClientGone (answered with 499 to a socket nobody reads)."""
    task = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                if task is not None:
                    task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if gone and task is not None and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    except APIError:
        if gone:  # the cancelled engine call surfaced as a 409/503: the reason is the client leaving
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
