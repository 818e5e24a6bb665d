"""The live event stream (`GET /v1/events`, Server-Sent Events) and the console page that reads it.

What the engine's coroutines do, as it happens, for the console (`/console`) and for any program:

    event: coroutine   a work was submitted: name, kind, priority, the block it writes, its view
    event: state       a coroutine's state changed: running, paused, waiting (resumed -> running)
    event: piece       a generation's step: the text it streamed and the tokens it wrote
    event: input       input was submitted into a block: the extend's coroutine, its tokens, and the
                       running coroutines that read that block (the barge-in moment)
    event: probe       a probe answered: each choice's probability
    event: end         a work finished: outcome (done, stop, length, cancelled or the error's type)
    event: step        one forward pass: its duration and each coroutine's prefill and decode tokens
    event: memory      block memory: KV, linear state, spilled, the budget (sent when it changes)
    event: sessions    the caller's sessions and their blocks (sent when they change)

Every event's data is one JSON object with `seq` and `t` (seconds since the server started).
The hub is fed by the engine's own listeners (`engine.work_listeners`, `engine.step_listeners`), the
same ones metrics and traces read. A new subscriber first gets the recent history, so a page opened
mid-run shows what is already running.

Scope: exactly as the rest of the API. With API keys, a key sees only the coroutines its requests
and sessions started and its own sessions; every other coroutine's step items are kept under the one
lane "others" with no ids (load is not a secret, as in /v1/timeline). Admin keys see everything.
Without keys every caller is the same anonymous principal and ids are the only thing separating
sessions, so a caller sees only load and memory, unless the server lists sessions without a key
anyway (`ServerSettings.list_sessions_without_key`, as `cothink demo --console` sets).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from cothink.server.errors import ERROR_RESPONSES
from cothink.server.state import ServerState, get_state, principal
from cothink.server.streaming import EventStream
from cothink.server.system_api import own_items

if TYPE_CHECKING:
    from cothink.runtime.engine import StepRecord, WorkEvent

__all__ = ["CONSOLE_PATHS", "Event", "EventHub", "router"]

HISTORY = 5000  # events a new subscriber is sent first (oldest dropped)
QUEUE = 20_000  # events waiting for one slow subscriber before its stream is ended (it reconnects)
TICK_S = 0.25  # how often memory is sampled (sent only when it changed)
SESSIONS_S = 1.0  # how often a subscriber's sessions are looked at (sent only when they changed)
MAX_SESSIONS = 64  # sessions listed per event (the most recent), blocks per session
MAX_BLOCKS = 64
PING_S = 10.0  # an SSE comment keeps idle connections open through proxies
MAX_PIECE_CHARS = 4000  # a piece's text is cut to its tail beyond this
FINISHED_OK = ("done", "stop", "length")


@dataclass(frozen=True)
class Event:
    """One event of the stream: `coroutine` names whose it is (None: everyone's, such as memory)."""

    seq: int
    kind: str
    coroutine: str | None
    data: dict[str, Any]
    step: StepRecord | None = None  # a step's record, scoped per subscriber when it is sent

    def sse(self, data: dict[str, Any] | None = None) -> str:
        body = json.dumps(data if data is not None else self.data, separators=(",", ":"))
        return f"id: {self.seq}\nevent: {self.kind}\ndata: {body}\n\n"


@dataclass(eq=False)
class _Running:
    """A submitted work the hub still considers live: whose, what it reads (for input readers)."""

    coroutine: str
    block: str
    view: tuple[str, ...]


@dataclass(eq=False)
class Subscriber:
    """One open stream: whose it is, what it may see, what waits to be sent (None: the end)."""

    me: str  # the caller's principal (a key's fingerprint, or "anonymous")
    sees_all: bool
    queue: asyncio.Queue[Event | None] = field(default_factory=lambda: asyncio.Queue(QUEUE))
    sessions_sent: str = ""  # the last sessions event's body
    sessions_at: float = 0.0  # time.monotonic() when the sessions were last looked at


class EventHub:
    """Turns work and step records into events, keeps the recent ones, fans them out to subscribers."""

    def __init__(self, state: ServerState):
        self.state = state
        self.instance = secrets.token_hex(6)  # a page that reconnects sees whether the server restarted
        self.t0 = time.perf_counter()
        self.seq = 0
        self.history: deque[Event] = deque(maxlen=HISTORY)
        self.running: list[_Running] = []
        self.subscribers: set[Subscriber] = set()
        self.memory_sent: dict[str, Any] = {}
        self.memory_at = 0.0  # perf_counter of the last memory sample
        self.ticker: asyncio.Task | None = None
        self.attached = False

    # ---- lifecycle ----------------------------------------------------------------------------
    def attach(self) -> None:
        if not self.attached:
            self.state.engine.work_listeners.append(self.on_work)
            self.state.engine.step_listeners.append(self.on_step)
            self.attached = True

    def close(self) -> None:
        """Detach from the engine and end every stream."""
        if self.attached:
            self.state.engine.work_listeners.remove(self.on_work)
            self.state.engine.step_listeners.remove(self.on_step)
            self.attached = False
        if self.ticker is not None:
            self.ticker.cancel()
            self.ticker = None
        for sub in list(self.subscribers):
            self.end(sub)

    # ---- listeners (event loop, inside the engine's step) -----------------------------------------
    def on_work(self, e: WorkEvent) -> None:
        name, t = e.coroutine, self._t(e.time)
        if e.event == "submit":
            self.running.append(_Running(name, e.block, e.view))
            self._emit(
                "coroutine",
                name,
                {
                    "name": name,
                    "kind": e.work,
                    "priority": e.priority,
                    "block": e.block if e.work != "probe" else None,
                    "view": list(e.view),
                    "tokens": int(e.value),
                    "state": "waiting",
                    "t": t,
                    **self._session_of(name),
                },
            )
            if e.work == "extend":
                readers = sorted(
                    {r.coroutine for r in self.running if e.block in r.view and r.coroutine != name}
                )
                self._emit(
                    "input",
                    name,
                    {"name": name, "block": e.block, "tokens": int(e.value), "readers": readers, "t": t},
                )
        elif e.event == "scheduled":
            self._emit("state", name, {"name": name, "state": "running", "wait_s": e.value, "t": t})
        elif e.event in ("paused", "resumed"):
            state = "paused" if e.event == "paused" else "running"
            self._emit("state", name, {"name": name, "state": state, "t": t})
        elif e.event == "first_token":
            self._emit("state", name, {"name": name, "state": "running", "ttft_s": e.value, "t": t})
        elif e.event == "piece":
            text = e.text[-MAX_PIECE_CHARS:]
            self._emit("piece", name, {"name": name, "text": text, "tokens": int(e.value), "t": t})
        elif e.event == "finish":
            self._forget(name, e.block if e.work != "probe" else None, e.work)
            if e.answer:
                answer = {choice: round(p, 6) for choice, p in e.answer}
                top = max(answer, key=answer.__getitem__)
                self._emit(
                    "probe",
                    name,
                    {"name": name, "answer": answer, "top": top, "probability": answer[top], "t": t},
                )
            outcome = e.detail or "done"
            state = "done" if outcome in FINISHED_OK else "cancelled" if outcome == "cancelled" else "failed"
            self._emit(
                "end",
                name,
                {
                    "name": name,
                    "kind": e.work,
                    "outcome": outcome,
                    "state": state,
                    "seconds": e.value,
                    "t": t,
                },
            )

    def on_step(self, record: StepRecord) -> None:
        self._emit("step", None, {}, step=record)
        if self.subscribers and record.end - self.memory_at >= TICK_S:
            self._sample_memory()

    # ---- events -------------------------------------------------------------------------------
    def _t(self, perf: float) -> float:
        return round(perf - self.t0, 6)

    def _emit(
        self, kind: str, coroutine: str | None, data: dict[str, Any], step: StepRecord | None = None
    ) -> None:
        self.seq += 1
        event = Event(self.seq, kind, coroutine, data, step)
        self.history.append(event)
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:  # a reader this far behind reconnects and gets the history
                self.end(sub)

    def _session_of(self, name: str) -> dict[str, Any]:
        """The session a coroutine runs in, with its blocks' names (empty for OpenAI requests)."""
        for session in self.state.sessions.sessions.values():
            if name in session.coroutines:
                labels = {b.id: b.name for b in session.blocks.values() if b.name}
                return {"session": session.id, "labels": labels}
        return {}

    def _forget(self, name: str, block: str | None, kind: str) -> None:
        for i, r in enumerate(self.running):
            if r.coroutine == name and (kind == "probe" or r.block == block):
                del self.running[i]
                return

    def _sample_memory(self) -> None:
        self.memory_at = time.perf_counter()
        data = memory_data(self.state)
        if data != self.memory_sent:
            self.memory_sent = data
            self._emit("memory", None, {**data, "t": self._t(time.perf_counter())})

    def end(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        while True:  # make room for the end marker
            try:
                sub.queue.put_nowait(None)
                return
            except asyncio.QueueFull:
                sub.queue.get_nowait()

    async def _tick(self) -> None:
        while self.subscribers:
            await asyncio.sleep(TICK_S)
            self._sample_memory()
        self.ticker = None

    # ---- subscribers --------------------------------------------------------------------------
    def subscribe(self, me: str, sees_all: bool) -> Subscriber:
        sub = Subscriber(me, sees_all)
        self.subscribers.add(sub)
        if self.ticker is None:
            self.ticker = asyncio.create_task(self._tick(), name="cothink-events-ticker")
        self.memory_sent = {}  # a fresh memory event, so the history always ends with one
        self._sample_memory()
        return sub

    def scoped(self, sub: Subscriber, event: Event) -> dict[str, Any] | None:
        """The event's data as `sub` may see it, or None when it is not theirs."""
        if event.step is not None:
            return step_data(self._scoped_step(sub, event.step), self.t0)
        if event.coroutine is None or sub.sees_all:
            return event.data
        if self.state.owners.get(event.coroutine) != sub.me:
            return None
        if event.kind == "input":  # readers of a block are in the block's own session
            mine = [r for r in event.data["readers"] if self.state.owners.get(r) == sub.me]
            return {**event.data, "readers": mine}
        return event.data

    def _scoped_step(self, sub: Subscriber, record: StepRecord) -> StepRecord:
        if sub.sees_all:
            return record
        return own_items([record], self.state, sub.me)[0]

    async def stream(self, sub: Subscriber, replay: bool, model: str) -> AsyncIterator[str]:
        hello = {
            "server": self.instance,
            "model": model,
            "sees_all": sub.sees_all,
            "t": self._t(time.perf_counter()),
            "seq": self.seq,
        }
        yield f"event: hello\ndata: {json.dumps(hello)}\n\n"
        try:
            backlog = list(self.history) if replay else []
            replayed = backlog[-1].seq if backlog else 0  # also queued since subscribe(): skip them there
            for event in backlog:
                data = self.scoped(sub, event)
                if data is not None:
                    yield event.sse({**data, "seq": event.seq, "replay": True})
            sessions = self._sessions(sub)
            if sessions is not None:
                yield sessions
            last_ping = time.monotonic()
            while not self.state.draining:
                try:
                    async with asyncio.timeout(TICK_S):  # not wait_for: it can swallow a cancel (3.11)
                        event = await sub.queue.get()
                except TimeoutError:
                    pass  # nothing new: look at the sessions, maybe ping
                else:
                    if event is None:
                        return
                    data = self.scoped(sub, event) if event.seq > replayed else None
                    if data is not None:
                        yield event.sse({**data, "seq": event.seq})
                    if not sub.queue.empty():
                        continue
                sessions = self._sessions(sub)
                if sessions is not None:
                    yield sessions
                if time.monotonic() - last_ping > PING_S:
                    last_ping = time.monotonic()
                    yield ": ping\n\n"
        finally:
            self.subscribers.discard(sub)

    def _sessions(self, sub: Subscriber) -> str | None:
        """The `sessions` event when the caller's sessions changed since the last one sent."""
        now = time.monotonic()
        if sub.sessions_sent and now - sub.sessions_at < SESSIONS_S:
            return None
        sub.sessions_at = now
        data = sessions_data(self.state, sub.me, sub.sees_all)
        body = json.dumps(data, separators=(",", ":"))
        if body == sub.sessions_sent:
            return None
        sub.sessions_sent = body
        return f"event: sessions\ndata: {body}\n\n"


# ---- payloads -----------------------------------------------------------------------------------
def step_data(record: StepRecord, t0: float) -> dict[str, Any]:
    """One forward pass: per coroutine, prefill (extend, probe) and decode (generate) tokens."""
    per: dict[str, dict[str, Any]] = {}
    for item in record.items:
        row = per.setdefault(
            item.coroutine, {"name": item.coroutine, "prefill": 0, "decode": 0, "priority": item.priority}
        )
        row["decode" if item.kind == "generate" else "prefill"] += item.tokens
    rows = list(per.values())
    return {
        "index": record.index,
        "t": round(record.start - t0, 6),
        "duration_ms": round((record.end - record.start) * 1000, 3),
        "prefill": sum(r["prefill"] for r in rows),
        "decode": sum(r["decode"] for r in rows),
        "coroutines": rows,
    }


def memory_data(state: ServerState) -> dict[str, Any]:
    """Block memory in bytes: KV pages used and in all, linear state, spilled, the budget."""
    m = state.engine.memory()
    total_pages = m.total_pages or (m.used_pages + m.free_pages)
    page_bytes = m.page_bytes or state.ledger.geometry.bytes_per_page
    return {
        "kv": m.kv_bytes_used,
        "kv_total": page_bytes * total_pages,
        "linear": m.linear_bytes_used,
        "spilled": m.spilled_bytes,
        "used": m.total_bytes_used,
        "budget": m.budget_bytes,
        "blocks": m.live_blocks,
        "used_pages": m.used_pages,
        "total_pages": total_pages,
    }


def sessions_data(state: ServerState, me: str, sees_all: bool) -> dict[str, Any]:
    """The sessions `me` may see (the most recent MAX_SESSIONS), each with its first MAX_BLOCKS live
    blocks (`block_count`: all of them) and its running coroutines."""
    out = []
    for session in reversed(list(state.sessions.sessions.values())):
        if len(out) == MAX_SESSIONS:
            break
        # a session's account is its key, or (without keys) the session itself: never "anonymous"
        if session.closed or not (sees_all or session.account == me):
            continue
        blocks = []
        for entry in session.blocks.values():
            b = entry.block
            if b.freed:
                continue
            blocks.append(
                {
                    "id": entry.id,
                    "name": entry.name,
                    "length": b.length,
                    "sealed": b.sealed,
                    "spilled": b.spilled is not None,
                    "pinned": b.pinned,
                }
            )
        running = [c.id for c in session.coroutines.values() if c.running]
        out.append(
            {
                "id": session.id,
                "name": session.name,
                "blocks": blocks[:MAX_BLOCKS],
                "block_count": len(blocks),
                "running": running,
            }
        )
    return {"sessions": out[::-1]}


# ---- routes -------------------------------------------------------------------------------------
router = APIRouter(tags=["system"])


def get_hub(request: Request) -> EventHub:
    return request.app.state.events


@router.get(
    "/v1/events",
    summary="Live events: coroutines, input, steps, memory and sessions (Server-Sent Events)",
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "One SSE event per engine event"},
        401: ERROR_RESPONSES[401],
    },
)
async def events(
    request: Request,
    state: ServerState = Depends(get_state),
    hub: EventHub = Depends(get_hub),
    replay: bool = Query(True, description="Send the recent history first"),
) -> Response:
    state.check_open()
    if state.settings.keys():
        sees_all = request.scope.get("cothink.admin") is True
    else:  # every caller is one anonymous principal and ids are the only secret: show them only
        sees_all = state.settings.list_sessions_without_key  # where sessions may be listed anyway
    sub = hub.subscribe(principal(request), sees_all)
    return EventStream(hub.stream(sub, replay, state.settings.model_name), on_disconnect=lambda: hub.end(sub))


# ---- the console page -----------------------------------------------------------------------------
CONSOLE_FILES = {
    "/console": ("index.html", "text/html; charset=utf-8"),
    "/console/": ("index.html", "text/html; charset=utf-8"),
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
}
CONSOLE_PATHS = frozenset(CONSOLE_FILES)  # static, no data: served without a key (the page asks for it)
# The page loads only its own files and talks only to this server.
CONSOLE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
    ),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def _console_file(name: str) -> bytes:
    return resources.files("cothink.server").joinpath("console", name).read_bytes()


def _console_route(path: str, name: str, media_type: str) -> Callable[[], Any]:
    async def serve() -> Response:
        return Response(_console_file(name), media_type=media_type, headers=CONSOLE_HEADERS)

    serve.__name__ = f"console_{name.replace('.', '_')}"
    return serve


for _path, (_name, _type) in CONSOLE_FILES.items():
    router.add_api_route(_path, _console_route(_path, _name, _type), methods=["GET"], include_in_schema=False)
