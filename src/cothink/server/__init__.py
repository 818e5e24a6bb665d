"""The cothink HTTP server: OpenAI-compatible completions plus a session API over blocks and coroutines.

    from cothink.server import create_app, ServerSettings, serve
    serve(create_app(engine, ServerSettings(model_name="smollm2")))

See docs/server.md. Names are imported lazily, so `cothink.server.cli` (the `cothink serve` parser) loads
without FastAPI or torch and `cothink --help` stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackgroundServer", "Server", "ServerSettings", "create_app", "serve"]

_WHERE = {
    "create_app": "cothink.server.app",
    "BackgroundServer": "cothink.server.runner",
    "Server": "cothink.server.runner",
    "serve": "cothink.server.runner",
    "ServerSettings": "cothink.server.settings",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'cothink.server' has no attribute {name!r}")
