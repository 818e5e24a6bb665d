"""LangChain chat model for cothink (`pip install cothink[langchain]`).

    from cothink.integrations.langchain import ChatCothink
    chat = ChatCothink.from_url("http://127.0.0.1:8000", api_key=KEY, model="smollm2")
    chat = ChatCothink.from_engine(engine, model="smollm2")     # serves the engine on loopback
    chat.invoke("Hi"); chat.stream("Hi"); await chat.ainvoke("Hi")
    chat.bind_tools([tool]); chat.with_structured_output(Schema)   # constrained: always parses

It is LangChain's `ChatOpenAI` pointed at cothink's OpenAI-compatible routes, so every LangChain feature
that works with OpenAI works here; tool calls and structured output are grammar-constrained on the
server. `chat.cothink` (from_engine) is the embedded server: `chat.cothink.client()` reaches the same
engine's session API (blocks, views, probes) from an agent's tools.
"""

from __future__ import annotations

from typing import Any

from langchain_openai import ChatOpenAI
from pydantic import PrivateAttr

from cothink.integrations import EmbeddedServer


class ChatCothink(ChatOpenAI):
    """A LangChain chat model served by cothink (see the module docstring)."""

    _cothink: EmbeddedServer | None = PrivateAttr(default=None)

    @classmethod
    def from_url(
        cls, url: str, api_key: str | None = None, model: str = "cothink", **kwargs: Any
    ) -> ChatCothink:
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return cls(base_url=base, api_key=api_key or "none", model=model, **kwargs)

    @classmethod
    def from_engine(cls, engine: Any, model: str = "cothink", **kwargs: Any) -> ChatCothink:
        """Serve `engine` on a free loopback port (with a random key) and talk to it."""
        server = EmbeddedServer.start(engine, model)
        chat = cls.from_url(server.url, server.api_key, model, **kwargs)
        chat._cothink = server
        return chat

    @property
    def cothink(self) -> EmbeddedServer:
        if self._cothink is None:
            raise RuntimeError("this model talks to a remote server: use cothink.client.Client(url) instead")
        return self._cothink

    @property
    def _llm_type(self) -> str:
        return "cothink"

    def close(self) -> None:
        """Stop the embedded server (from_engine); the engine stops with it."""
        if self._cothink is not None:
            self._cothink.stop()
            self._cothink = None
