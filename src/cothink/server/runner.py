"""Running the app with uvicorn: a blocking `serve` for the CLI and a `BackgroundServer` for tests.

Both use `Server`, a uvicorn.Server that ends running generations (finish reason 'cancelled') and stops
the engine *before* uvicorn waits for open connections, so a shutdown never waits on a long stream, and
that answers new requests with 503 while the requests in flight finish (`Server._finish_requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from cothink.server.connections import ConnectionLimits, guarded_h11


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.cothink_app = app

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start a graceful shutdown (a second SIGINT forces it); unlike plain uvicorn the
        signal is not raised again afterwards, so `cothink serve` exits 0 after a clean shutdown."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.cothink_app.state, "cothink", None)
        if state is not None:
            await state.drain()
            await self._finish_requests()
        await super().shutdown(sockets)

    async def _finish_requests(self) -> None:
        """Keep listening while the requests that began before the shutdown finish (at most
        `timeout_graceful_shutdown`): a new request meanwhile gets 503 `shutting_down` and its
        connection closes after that answer. Idle keep-alive connections close now. Then uvicorn
        stops listening, and later connection attempts are refused."""
        for connection in list(self.server_state.connections):
            connection.shutdown()
        limit = self.config.timeout_graceful_shutdown
        deadline = time.monotonic() + (limit if limit is not None else float("inf"))
        while self.server_state.tasks and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def make_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's options for `app`: h11 with the connection limits of the app's ServerSettings
    (cothink.server.connections), idle keep-alive connections closed after `timeout_keep_alive`."""
    state = getattr(app.state, "cothink", None)
    limits = state.settings.connection_limits() if state is not None else ConnectionLimits()
    options: dict[str, Any] = dict(
        host=host,
        port=port,
        log_config=None,
        lifespan="on",
        http=guarded_h11(limits),
        ws="websockets-sansio",
        timeout_keep_alive=5,
        timeout_graceful_shutdown=10,
        access_log=True,
        server_header=False,
    )
    options.update(kwargs)
    return uvicorn.Config(app, **options)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully (blocking)."""
    Server(make_config(app, host, port, **kwargs), app).run()


class BackgroundServer:
    """Serve `app` on a loopback port in a daemon thread (its own event loop), for tests and notebooks.

    with BackgroundServer(create_app(engine, settings)) as server:
        httpx.get(server.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, **kwargs: Any):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a response written as headers + body waits for
        # the client's delayed ACK (~40 ms per request on Linux loopback).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        kwargs.setdefault("access_log", False)
        self.server = Server(make_config(app, self.host, self.port, **kwargs), app)
        self.thread = threading.Thread(target=self._run, name="cothink-server", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self.error = exc

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.error!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Ask for a graceful shutdown and wait; True when the thread ended within `timeout`."""
        self.server.should_exit = True
        self.thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass
        return not self.thread.is_alive()

    def call(self, fn, *args: Any, timeout: float = 30.0) -> Any:
        """Run fn(*args) on the server's event loop thread (e.g. to read engine state safely)."""
        assert self.loop is not None

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
