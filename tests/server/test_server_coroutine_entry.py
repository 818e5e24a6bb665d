"""Coroutines of the session API on a real loopback server: the engine's checks reach the client as
they are, every token of a generation arrives in a token event, and an entry that fails leaves
nothing running or reserved."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from support import running_server, sse_events, tiny_engine
from websockets.sync.client import connect as ws_connect

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cothink.errors import InvalidTokenIdError
from cothink.server import ServerSettings
from cothink.server.coroutines import coroutine_entry
from cothink.server.state import ServerState

KEY = "key-entry-0123456789"


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(
        model_name="tiny", api_keys=(KEY,), max_tokens_per_request=64, session_max_tokens=2000
    )
    engine = tiny_engine()
    with running_server(engine, settings) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def engine_message(engine, param: str) -> str:
    """What the engine says about an out-of-vocabulary token id in `param`."""
    with pytest.raises(InvalidTokenIdError) as err:
        engine.runner.check_token_ids([engine.runner.config.vocab_size], param)
    return str(err.value)


def new_session(http) -> tuple[str, str]:
    sid = http.post("/v1/sessions").json()["id"]
    blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "Once upon a time"}).json()["id"]
    return sid, blk


def test_invalid_token_ids_answer_with_the_engines_error(server, http):
    vocab = server.engine.runner.config.vocab_size
    sid, blk = new_session(http)
    base = f"/v1/sessions/{sid}"
    before = http.get(base).json()["usage"]["tokens"]
    out = http.post(f"{base}/blocks").json()["id"]
    requests = [
        (f"{base}/blocks/{blk}/extend", {"token_ids": [5, vocab]}, "token_ids"),
        (f"{base}/blocks", {"token_ids": [vocab]}, "token_ids"),
        (
            f"{base}/generate",
            {"view": [blk, out], "stop_token_ids": [vocab], "stream": False},
            "stop_token_ids",
        ),
        (f"{base}/generate", {"view": [blk, out], "banned_token_ids": [vocab]}, "banned_token_ids"),
        (f"{base}/probe", {"view": [blk], "question": [vocab]}, "question"),
    ]
    for path, body, param in requests:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"] == {
            "message": engine_message(server.engine, param),
            "type": "invalid_request_error",
            "code": "invalid_token_id",
            "param": param,
        }, path
    # the refused calls wrote nothing, reserved nothing and left nothing running
    info = http.get(base).json()
    assert info["usage"]["tokens"] == before and info["usage"]["running"] == 0
    assert http.get(f"{base}/blocks/{blk}").json()["text"] == "Once upon a time"
    assert len(http.get(f"{base}/blocks").json()["data"]) == 2  # the refused block was deleted again
    failed = http.get(f"{base}/coroutines").json()["data"][1:]  # after the block's first write
    assert [(c["kind"], c["status"]) for c in failed] == [
        ("extend", "failed"),
        ("extend", "failed"),
        ("generate", "failed"),
        ("generate", "failed"),
        ("probe", "failed"),
    ]
    assert [c["finish_reason"] for c in failed] == [None, None, "error", "error", None]
    assert all(c["error"].endswith(f"must be ints in [0, {vocab})") for c in failed)
    # the block is writable again at once
    assert http.post(f"{base}/blocks/{blk}/extend", json={"token_ids": [5]}).status_code == 200
    # so are the engine's view rules
    r = http.post(f"{base}/blocks/{blk}/extend", json={"token_ids": [5], "view": [blk, out]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_view"
    assert r.json()["error"]["param"] == "view" and blk in r.json()["error"]["message"]

    url = server.url.replace("http://", "ws://") + f"{base}/ws"
    with ws_connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "extend", "id": "x", "block": blk, "token_ids": [vocab]}))
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error" and event["id"] == "x"
    assert event["error"]["code"] == "invalid_token_id" and event["error"]["param"] == "token_ids"

    # the OpenAI routes name their own fields
    prompt = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, vocab], "max_tokens": 2})
    assert prompt.status_code == 400 and prompt.json()["error"]["code"] == "invalid_token_id"
    assert prompt.json()["error"]["param"] == "prompt"
    bias = http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logit_bias": {str(vocab): -100}},
    )
    assert bias.status_code == 400 and bias.json()["error"]["code"] == "invalid_token_id"
    assert bias.json()["error"]["param"] == "logit_bias"
    http.delete(base)


def stream(http, sid: str, view: list[str], **body) -> list[dict]:
    """The SSE events of a seeded sampled generation (varied tokens; the same ones on every call)."""
    body = {"view": view, "temperature": 1.0, "seed": 3, "stop_at_eos": False, **body}
    with http.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        assert r.status_code == 200
        return sse_events(r)


def test_every_token_arrives_in_a_token_event(server, http):
    """Whatever ends a generation, its token events add up to the end event, the final token
    included, in its own event: the stream sends the engine's pieces as they are."""
    sid, prompt = new_session(http)
    blank = lambda: http.post(f"/v1/sessions/{sid}/blocks").json()["id"]  # noqa: E731
    full = stream(http, sid, [prompt, blank()], max_tokens=24)[-1]
    k = next(i for i in range(3, 24) if full["token_ids"][i] not in full["token_ids"][:i])
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cases = [
        (dict(max_tokens=7), "length"),
        (dict(max_tokens=24, stop_token_ids=[full["token_ids"][k]]), "stop"),
        (dict(max_tokens=24, stop=[stop]), "stop"),
    ]
    for body, reason in cases:
        out = blank()
        events = stream(http, sid, [prompt, out], **body)
        end, tokens = events[-1], [e for e in events if e["type"] == "token"]
        assert end["type"] == "end" and end["finish_reason"] == reason, body
        assert [len(e["token_ids"]) for e in tokens] == [1] * len(end["token_ids"]), body
        assert tokens[-1]["token_ids"] == end["token_ids"][-1:], body
        assert [t for e in tokens for t in e["token_ids"]] == end["token_ids"], body
        assert "".join(e["text"] for e in tokens) == end["text"], body
        co = http.get(f"/v1/sessions/{sid}/coroutines/{end['coroutine']}").json()
        assert co["text"] == end["text"] and co["tokens"] == len(end["token_ids"])
        assert (
            http.get(f"/v1/sessions/{sid}/blocks/{out}?token_ids=true").json()["token_ids"]
            == end["token_ids"]
        )
    http.delete(f"/v1/sessions/{sid}")


def test_a_cancelled_stream_carries_every_written_token(server, http):
    """Cancelled from another request mid-stream, a generation's token events still add up to what
    it wrote into its block (also the tokens that were queued when the cancel came)."""
    sid, prompt = new_session(http)
    out = http.post(f"/v1/sessions/{sid}/blocks").json()["id"]
    body = {"view": [prompt, out], "max_tokens": 64, "temperature": 1.0, "seed": 3, "stop_at_eos": False}
    events = []
    with http.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:  # start, then the first token
                co = events[0]["coroutine"]
                assert http.post(f"/v1/sessions/{sid}/coroutines/{co}/cancel").status_code == 200
    end = events[-1]
    assert end["type"] == "end" and end["finish_reason"] in ("cancelled", "length")
    streamed = [t for e in events if e["type"] == "token" for t in e["token_ids"]]
    assert streamed == end["token_ids"]
    assert http.get(f"/v1/sessions/{sid}/blocks/{out}?token_ids=true").json()["token_ids"] == streamed
    assert http.get(f"/v1/sessions/{sid}/coroutines/{end['coroutine']}").json()["tokens"] == len(streamed)
    http.delete(f"/v1/sessions/{sid}")


async def test_a_failed_entry_leaves_nothing_running_or_reserved():
    """Whatever fails inside a coroutine's entry (here an error that is no APIError, after a
    generation's entry would have handed the coroutine on) records it as failed, releases its
    reservation and ends its span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = tiny_engine()
    async with engine:
        state = ServerState(engine, ServerSettings(model_name="tiny", session_max_tokens=1000), provider)
        session = state.sessions.create("me")
        entry = session.new_block(None)
        before = session.usage()
        with pytest.raises(RuntimeError):
            with coroutine_entry(
                state, session, "generate", "broken", [entry], entry, 64, outlives_entry=True
            ):
                assert session.usage()["running"] == 1 and session.usage()["tokens"] == before["tokens"] + 64
                raise RuntimeError("a bug")
        with pytest.raises(asyncio.CancelledError):
            with coroutine_entry(state, session, "extend", "gone", [entry], entry, 8):
                raise asyncio.CancelledError()
        broken, gone = session.coroutines.values()
        assert (broken.status, broken.finish_reason, broken.error) == (
            "failed",
            "error",
            "internal server error",
        )
        assert (gone.status, gone.finish_reason, gone.error) == ("failed", None, "cancelled")
        assert session.usage() == before
        ended = {s.name: s.attributes["cothink.error"] for s in exporter.get_finished_spans()}
        assert ended == {
            "cothink.session.generate": "internal server error",
            "cothink.session.extend": "cancelled",
        }
        state.sessions.close_all()
