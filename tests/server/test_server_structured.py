"""OpenAI features through the official `openai` client: structured output, tool calls, logprobs,
usage on stream chunks. On the tiny random-weight model: the grammar constraint alone guarantees that
every finished output parses against its schema, whatever the weights."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from support import running_server, sse_events, tiny_engine

from cothink.server import ServerSettings

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad", "neutral"]},
            "confident": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["mood", "confident", "score"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
            "points": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["tags", "points"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_engine(), ServerSettings(model_name="tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_always_parse(client, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=1.0, seed=7, n=4, response_format=fmt
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    greedy = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(greedy.choices[0].message.content), schema)


def test_json_object_mode_and_streaming(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "enums", "schema": SCHEMAS["enums"]}}
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=200, temperature=0, response_format=fmt, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["enums"])
    obj = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_required_and_named_tool_calls_parse_against_their_schema(client):
    for choice, names in (
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ):
        for seed in range(3):
            reply = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER, CLOCK],
                tool_choice=choice,
                max_tokens=120,
                temperature=1.0,
                seed=seed,
            )
            c = reply.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None
            call = c.message.tool_calls[0]
            assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
            tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_auto_and_none_tool_choice_and_history(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        )
        c = reply.choices[0]
        if c.message.tool_calls:  # auto: a call, if the model makes one, always parses
            assert c.finish_reason == "tool_calls"
            jsonschema.validate(
                json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
            )
        else:
            assert not c.message.content.startswith("{")
    none = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=5,
        temperature=0,
    )
    assert none.choices[0].message.tool_calls is None
    # a conversation with a call and its result renders (fallback format: SmolLM2 has no tool template)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    after = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=4, temperature=0, tool_choice="none"
    )
    assert after.usage.prompt_tokens > 40  # the tool list, the call and its result are all in the prompt


def test_streamed_tool_call(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Time?"}],
            tools=[CLOCK],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_logprobs_chat_and_completions(client):
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy: the top one was chosen
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    stream = list(
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=5, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    comp = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_usage_on_every_completion_stream_chunk(server):
    body = {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = [e for e in sse_events(httpx.post(server.url + "/v1/completions", json=body)) if e != "[DONE]"]
    assert all("usage" in e for e in events)
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 3


def test_session_generate_with_a_schema_and_bad_schemas(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "JSON:"}).json()["id"]
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["arrays"]}}
        r = http.post(
            f"/v1/sessions/{sid}/generate",
            json={"view": [blk], "max_tokens": 200, "stream": False, "response_format": fmt, "logprobs": 1},
        ).json()
        jsonschema.validate(json.loads(r["text"]), SCHEMAS["arrays"])
        bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "no-such-type"}}}
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
