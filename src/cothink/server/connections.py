"""Slow clients at the connection level, before any request is read or authenticated.

uvicorn's h11 protocol bounds the size of a request head (`h11_max_incomplete_event_size`) and the
idle time between requests on a keep-alive connection (`timeout_keep_alive`), but not how long a
client may take to send a request: any received byte cancels the keep-alive timer, so a client that
trickles header bytes, or a body slower than it announced, holds its connection forever.
`guarded_h11(limits)` is uvicorn's h11 protocol with three limits more (docs/server.md, "Threat model"):

- a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous response ending. The deadline is fixed: trickled bytes do
  not extend it;
- its body must arrive within `body_timeout_s` of its head;
- at most `max_pending_connections` connections may wait for a request head at once; one more
  closes the connection that has waited longest, so slow clients cannot keep fast ones out.

A connection past a deadline is closed; a request whose body stopped sees the client disconnect, as
for any client that leaves. A WebSocket, once upgraded, is no longer watched here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("cothink.server")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # a request head must arrive within this (from connect or last response)
    body_timeout_s: float = 30.0  # a request body must arrive within this of its head
    max_pending_connections: int = 64  # connections waiting for a request head; more evict the oldest


def guarded_h11(limits: ConnectionLimits) -> type[H11Protocol]:
    """An h11 protocol class for uvicorn.Config(http=...) that enforces `limits` on one server."""
    # Connections waiting for a request head, oldest first (dicts keep insertion order). One event
    # loop runs every protocol instance of a server, so no lock is needed.
    pending: dict[GuardedH11Protocol, None] = {}

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _seen_cycle: Any = None  # the request whose head arrived last
        _waiting_for = ""  # "request head", "request body" or "" (nothing to wait for)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()
            while len(pending) > limits.max_pending_connections:
                oldest = next(iter(pending))
                oldest._close(f"{limits.max_pending_connections} connections were already waiting")

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._await_head()  # before pipelined requests are read: their heads are here already
            super().on_response_complete()
            self._track()

        def _track(self) -> None:
            """Move from waiting for a head to waiting for its body to waiting for nothing."""
            if self.transport.get_protocol() is not self:  # upgraded to a WebSocket
                self._stop_waiting()
                return
            cycle = self.cycle
            if cycle is None:
                return
            if cycle is not self._seen_cycle:  # a new request's head arrived
                self._seen_cycle = cycle
                pending.pop(self, None)
                if cycle.more_body:
                    self._arm("request body", limits.body_timeout_s)
                else:
                    self._disarm()
            elif self._waiting_for == "request body" and not cycle.more_body:
                self._disarm()

        def _await_head(self) -> None:
            pending[self] = None
            self._arm("request head", limits.header_timeout_s)

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting_for = what
            self._deadline = self.loop.call_later(seconds, self._close, f"its {what} took over {seconds:g} s")

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._waiting_for = None, ""

        def _stop_waiting(self) -> None:
            pending.pop(self, None)
            self._disarm()

        def _close(self, why: str) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
                client = "%s:%d" % self.client if self.client else "a client"
                log.warning("closed the connection from %s: %s", client, why)
                self.transport.close()

    return GuardedH11Protocol
