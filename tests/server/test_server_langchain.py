"""LangChain's own `ChatOpenAI`, unchanged, against the server (tiny random-weight model: the grammar
constraint makes tool calls and structured output parse whatever the weights)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from support import running_server, tiny_engine

from cothink.server import ServerSettings

langchain_openai = pytest.importorskip("langchain_openai")
KEY = "sk-langchain-test"


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def chat():
    settings = ServerSettings(model_name="tiny", api_keys=(KEY,))
    with running_server(tiny_engine(), settings) as srv:
        yield langchain_openai.ChatOpenAI(
            model="tiny", base_url=srv.url + "/v1", api_key=KEY, max_tokens=100, temperature=0, max_retries=0
        )


def test_invoke_stream_batch(chat):
    reply = chat.invoke("Hello")
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] >= 1
    streamed = "".join(chunk.content for chunk in chat.stream("Hello"))
    assert streamed == reply.content  # greedy: the same text streamed or not
    assert [m.content for m in chat.batch(["Hello", "Hello"])] == [reply.content, reply.content]


def test_bind_tools_and_structured_output(chat):
    forced = chat.bind_tools([Weather], tool_choice="Weather")
    msg = forced.invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
    Weather(**msg.tool_calls[0]["args"])  # the arguments satisfy the schema
    for method in ("function_calling", "json_schema"):
        out = chat.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(out, Weather)


def test_logprobs(chat):
    msg = chat.bind(logprobs=True, top_logprobs=2).invoke("Hello")
    content = msg.response_metadata["logprobs"]["content"]
    assert content and all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in content)
