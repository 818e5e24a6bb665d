"""Agent-framework integrations (optional extras): `cothink.integrations.langchain` (pip install
cothink[langchain]) and `cothink.integrations.llama_index` (pip install cothink[llama-index]).

Both speak to a cothink server (a URL, or one started in-process on a loopback port for an Engine
you hold), so streaming, async, tool calling, structured output and logprobs come from the server's
OpenAI-compatible routes, and the same engine stays reachable through `cothink.client` for what only
cothink does (blocks, views, probes of running coroutines).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


@dataclass
class EmbeddedServer:
    """A cothink server on a free loopback port, serving an in-process Engine (one per engine)."""

    url: str
    api_key: str
    model: str
    server: Any

    @classmethod
    def start(cls, engine: Any, model: str = "cothink", **settings: Any) -> EmbeddedServer:
        from cothink.server import BackgroundServer, ServerSettings, create_app

        key = f"sk-local-{secrets.token_urlsafe(16)}"
        app = create_app(engine, ServerSettings(model_name=model, api_keys=(key,), **settings))
        server = BackgroundServer(app).start()
        return cls(server.url, key, model, server)

    def client(self) -> Any:
        """A `cothink.client.AsyncClient` for the session API of the same engine."""
        from cothink.client import AsyncClient

        return AsyncClient(self.url, api_key=self.api_key)

    def sync_client(self) -> Any:
        from cothink.client import Client

        return Client(self.url, api_key=self.api_key)

    def stop(self) -> None:
        self.server.stop()
