"""LlamaIndex LLM for cothink (`pip install cothink[llama-index]`).

    from cothink.integrations.llama_index import CothinkLLM
    llm = CothinkLLM.from_url("http://127.0.0.1:8000", api_key=KEY, model="smollm2")
    llm = CothinkLLM.from_engine(engine, model="smollm2")       # serves the engine on loopback
    llm.complete("Hi"); llm.chat([ChatMessage(role="user", content="Hi")]); llm.stream_complete("Hi")

LlamaIndex's `OpenAILike` pointed at cothink's OpenAI-compatible routes: a chat model with function
calling (grammar-constrained on the server, so calls always parse) and streaming, sync and async.
"""

from __future__ import annotations

from typing import Any

from llama_index.llms.openai_like import OpenAILike
from pydantic import PrivateAttr

from cothink.integrations import EmbeddedServer


class CothinkLLM(OpenAILike):
    """A LlamaIndex LLM served by cothink (see the module docstring)."""

    _cothink: EmbeddedServer | None = PrivateAttr(default=None)

    @classmethod
    def from_url(
        cls,
        url: str,
        api_key: str | None = None,
        model: str = "cothink",
        context_window: int = 8192,
        **kw: Any,
    ) -> CothinkLLM:
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        kw.setdefault("is_chat_model", True)
        kw.setdefault("is_function_calling_model", True)
        return cls(model=model, api_base=base, api_key=api_key or "none", context_window=context_window, **kw)

    @classmethod
    def from_engine(cls, engine: Any, model: str = "cothink", **kw: Any) -> CothinkLLM:
        """Serve `engine` on a free loopback port (with a random key) and talk to it."""
        server = EmbeddedServer.start(engine, model)
        llm = cls.from_url(server.url, server.api_key, model, **kw)
        llm._cothink = server
        return llm

    @property
    def cothink(self) -> EmbeddedServer:
        if self._cothink is None:
            raise RuntimeError("this LLM talks to a remote server: use cothink.client.Client(url) instead")
        return self._cothink

    @classmethod
    def class_name(cls) -> str:
        return "CothinkLLM"

    def close(self) -> None:
        if self._cothink is not None:
            self._cothink.stop()
            self._cothink = None
