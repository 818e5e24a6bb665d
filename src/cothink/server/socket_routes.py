"""The session WebSocket: generate, extend, probe and cancel messages in, their events out."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from cothink.observability.logs import session_var
from cothink.server.coroutines import Running, do_probe, extend_from, start_generation
from cothink.server.errors import APIError, from_exception, validation_error
from cothink.server.schemas import WsCancel, WsExtend, WsGenerate, WsMessage, WsProbe
from cothink.server.sessions import Session
from cothink.server.state import ServerState, get_ws_state, principal

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
log = logging.getLogger("cothink.server")

_WS_MESSAGE = TypeAdapter(WsMessage)
_WS_TYPES = ("generate", "extend", "probe", "cancel")
MAX_WS_DEPTH = 512  # arrays and objects nested deeper are refused before parsing (code too_deep)
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped) or a bracket


def nesting_depth(raw: str) -> int:
    """The deepest nesting of arrays and objects in a JSON text, strings skipped, without parsing it
    (json.loads's own limit is the interpreter's recursion limit, which depends on the stack it is
    called from)."""
    depth = deepest = 0
    for m in _JSON_TOKENS.finditer(raw):
        c = m.group()
        if c == "[" or c == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif c == "]" or c == "}":
            depth -= 1
    return deepest


def ws_validation_error(exc: ValidationError) -> APIError:
    """validation_error for a WebSocket message: the message type tag is not part of the field."""
    errors = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        errors.append({**e, "loc": loc[1:] if loc and loc[0] in _WS_TYPES else loc})
    err = validation_error(errors)
    err.code = "invalid_message" if err.code == "invalid_request" else err.code
    return err


@router.websocket("/{session_id}/ws")
async def session_socket(websocket: WebSocket, session_id: str) -> None:
    """Full duplex: send generate / extend / probe / cancel messages; events stream back as JSON."""
    state = get_ws_state(websocket)
    try:
        session = state.sessions.get(session_id, principal(websocket))
    except APIError:
        await websocket.close(code=1008, reason="no such session")
        return
    await websocket.accept()
    session_var.set(session.id)
    state.streams_gauge.inc()
    session.sockets += 1
    socket = _SessionSocket(websocket, state, session)
    try:
        await socket.serve()
    except WebSocketDisconnect:
        pass
    except RuntimeError:  # the socket closed under us (server shutdown)
        pass
    finally:
        session.sockets -= 1
        await socket.close()
        state.streams_gauge.dec()


class _SessionSocket:
    """One WebSocket on a session: reads messages, runs each request as its own task, sends events
    (one sender at a time) and cancels what it started when the socket goes."""

    def __init__(self, websocket: WebSocket, state: ServerState, session: Session):
        self.websocket, self.state, self.session = websocket, state, session
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.mine: dict[str, Running] = {}

    async def serve(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            msg = await self.parse(message.get("text"))
            if msg is None:
                continue
            if isinstance(msg, WsGenerate):
                self.spawn(self.run_generate(msg))
            elif isinstance(msg, WsExtend):
                self.spawn(self.run_extend(msg))
            elif isinstance(msg, WsProbe):
                self.spawn(self.run_probe(msg))
            else:
                await self.cancel(msg)

    async def parse(self, raw: str | None) -> Any:
        """The message, or None after sending the client an error for it."""
        if raw is None:
            err = APIError(400, "binary frames are not supported: send JSON as text", code="invalid_message")
            await self.send({"type": "error", **err.body()}, None)
            return None
        # the same size limit as HTTP bodies, checked before parsing or tokenizing anything
        limit = self.state.settings.max_body_bytes
        if len(raw) > limit and len(raw.encode("utf-8", "surrogatepass")) > limit:
            err = APIError(413, f"message exceeds {limit} bytes", code="body_too_large")
            await self.send({"type": "error", **err.body()}, None)
            return None
        deep = raw.count("[") + raw.count("{") > MAX_WS_DEPTH and nesting_depth(raw) > MAX_WS_DEPTH
        try:  # json.loads, as for HTTP bodies: a lone surrogate escape is then a 400 naming its field
            if not deep:
                return _WS_MESSAGE.validate_python(json.loads(raw))
        except json.JSONDecodeError:
            err = APIError(400, "the message is not valid JSON", code="invalid_json")
            await self.send({"type": "error", **err.body()}, None)
        except ValidationError as exc:
            await self.send({"type": "error", **ws_validation_error(exc).body()}, None)
        except RecursionError:  # a safety net: the scan refuses such messages first
            deep = True
        if deep:  # arrays or objects nested too deep; the socket stays open
            log.warning("refused a WebSocket message nested too deep", extra={"session": self.session.id})
            err = APIError(400, "the message nests arrays or objects too deep", code="too_deep")
            await self.send({"type": "error", **err.body()}, None)
        return None

    async def send(self, event: dict, ref: str | None) -> None:
        if ref is not None:
            event = {**event, "id": ref}
        async with self.lock:
            await self.websocket.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))

    async def send_error(self, exc: BaseException, ref: str | None) -> None:
        err = from_exception(exc)
        await self.send({"type": "error", "coroutine": None, **err.body()}, ref)

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run_generate(self, msg: WsGenerate) -> None:
        try:
            running = start_generation(self.state, self.session, msg)
        except Exception as exc:
            await self.send_error(exc, msg.id)
            return
        self.mine[running.co.id] = running
        try:
            async for event in running.events():
                await self.send(event, msg.id)
        finally:
            self.mine.pop(running.co.id, None)

    async def run_extend(self, msg: WsExtend) -> None:
        try:
            entry = self.session.block(msg.block)
            await extend_from(self.state, self.session, entry, msg)
            await self.send({"type": "extended", "block": entry.id, "length": entry.block.length}, msg.id)
        except Exception as exc:
            await self.send_error(exc, msg.id)

    async def run_probe(self, msg: WsProbe) -> None:
        try:
            result = await do_probe(self.state, self.session, msg)
            await self.send({"type": "probe", **result.model_dump()}, msg.id)
        except Exception as exc:
            await self.send_error(exc, msg.id)

    async def cancel(self, msg: WsCancel) -> None:
        if msg.coroutine is not None:
            try:
                targets = [self.session.coroutine(msg.coroutine)]
            except APIError as exc:
                await self.send_error(exc, msg.id)
                return
        else:
            targets = [r.co for r in self.mine.values()]
        cancelled = [co.id for co in targets if co.cancel()]
        await self.send({"type": "cancelled", "coroutines": cancelled}, msg.id)

    async def close(self) -> None:
        for running in list(self.mine.values()):
            running.co.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
