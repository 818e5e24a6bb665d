"""The official `openai` client, unchanged, against the server's app on SmolLM2 (real loopback server)."""

from __future__ import annotations

import httpx
import openai
import pytest
from support import running_server

from cothink.server import ServerSettings

pytestmark = pytest.mark.slow
KEY = "sk-test-openai"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server():
    import cothink

    engine = cothink.Engine.from_pretrained("smollm2")
    settings = ServerSettings(model_name="smollm2", api_keys=(KEY,), max_tokens_per_request=64)
    with running_server(engine, settings) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"


def test_chat_streaming_matches_non_streaming(client, server):
    free_before = server.call(lambda: server.engine.memory().free_pages)
    reply = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10 and 1 <= reply.usage.completion_tokens <= 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")

    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: same answer streamed or not
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    # the second request reused the first one's prompt from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens - 1
    # every request's own blocks were released; the cache gives its pages back when cleared
    server.call(server.app.state.cothink.prefix_cache.clear)
    assert server.call(lambda: server.engine.memory().free_pages) == free_before


def test_completions_streaming_and_not(client):
    prompt = "The capital of France is"
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
    assert out.choices[0].text and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 4
    stream = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text
    echo = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(prompt)


def test_sampling_seed_stop_and_n(client):
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=3, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b  # same seed, same sample
    two = client.completions.create(seed=1234, n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    greedy = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=5, temperature=0)
    text = greedy.choices[0].text
    assert "," in text
    cut = client.completions.create(
        model="smollm2", prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, stop=[","]
    )
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text.split(",")[0]


def test_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=10_000)
    assert err.value.code == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
            max_tokens=2,
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "smollm2", "messages": "not a list"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_structured_output_and_tool_calls_on_smollm2(client):
    import json

    import jsonschema

    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["name", "age", "hobbies"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    messages = [{"role": "user", "content": "Invent a person: name, age and hobbies, as JSON."}]
    reply = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=64, temperature=0, response_format=fmt
    )
    assert reply.choices[0].finish_reason == "stop"
    data = json.loads(reply.choices[0].message.content)
    jsonschema.validate(data, person)
    assert any(ch.isalpha() for ch in data["name"])  # a real model writes a name, not noise
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    call = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
    )
    assert call.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.choices[0].message.tool_calls[0].function.arguments)
    assert isinstance(args["city"], str) and args["city"]
