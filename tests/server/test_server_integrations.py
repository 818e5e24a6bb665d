"""cothink.integrations against the real LangChain (and LlamaIndex) packages, over an in-process engine."""

from __future__ import annotations

import asyncio
import importlib.util
import io
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from support import tiny_chat_model_dir, tiny_engine

pytest.importorskip("langchain_openai")
ROOT = Path(__file__).resolve().parents[2]


def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class WeatherArgs(BaseModel):
    city: Literal["Paris", "Rome"]


class Answer(BaseModel):
    verdict: Literal["yes", "no"]
    reason: str = Field(max_length=20)


def test_chat_cothink_over_an_in_process_engine():
    from cothink.integrations.langchain import ChatCothink

    chat = ChatCothink.from_engine(tiny_engine(), model="tiny", max_tokens=60, temperature=0)
    try:
        text = chat.invoke("Hi").content
        assert isinstance(text, str) and text

        async def streamed() -> str:
            return "".join([chunk.content async for chunk in chat.astream("Hi")])

        assert asyncio.run(streamed()) == text  # async streaming, same greedy text
        out = chat.with_structured_output(Answer).invoke("Is it raining?")
        assert isinstance(out, Answer)
        with chat.cothink.sync_client() as client, client.session() as s:  # the same engine's session API
            assert s.block("shared memory").length > 0
    finally:
        chat.close()


def test_langchain_narrator_example_runs():
    spec = importlib.util.spec_from_file_location(
        "langchain_narrator", ROOT / "examples/langchain_narrator.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = io.StringIO()
    result = asyncio.run(example.run(str(tiny_chat_model_dir()), think_tokens=24, agent_tokens=60, out=out))
    assert [t["tool"] in ("read_thoughts", "answer_found") for t in result["trace"]] == [True, True]
    assert isinstance(result["summary"], str) and "[narrator]" in out.getvalue()


def test_llama_index_llm_over_an_in_process_engine():
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool

    from cothink.integrations.llama_index import CothinkLLM

    llm = CothinkLLM.from_engine(
        tiny_engine(), model="tiny", max_tokens=40, temperature=0, context_window=2048
    )
    try:
        text = llm.complete("Hello").text
        assert "".join(r.delta or "" for r in llm.stream_complete("Hello")) == text
        reply = llm.chat([ChatMessage(role="user", content="Hello")])
        assert reply.message.content == text or isinstance(reply.message.content, str)
        tool = FunctionTool.from_defaults(fn=get_weather, fn_schema=WeatherArgs)
        response = llm.chat_with_tools([tool], user_msg="Weather in Paris?", tool_required=True)
        calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
        assert calls[0].tool_name == "get_weather" and calls[0].tool_kwargs["city"] in ("Paris", "Rome")
    finally:
        llm.close()
