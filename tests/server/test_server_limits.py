"""Limits an attacker reaches first, each against a real uvicorn server on loopback: schemas beyond the
grammar matcher, messages nested too deep or not UTF-8, slow clients before authentication, and
requests that arrive while the server shuts down.

The model is the tiny random-weight Llama with SmolLM2's tokenizer (tests/support.py).
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from support import running_server, sse_events, tiny_engine, wait_for
from websockets.sync.client import connect as ws_connect

from cothink.server import BackgroundServer, ServerSettings, create_app

ASK = [{"role": "user", "content": "Give me JSON."}]
# Both compile, and both stop the matcher at its first token: a row of more options than it keeps,
# and a reference that only refers to itself.
SCHEMA_PROBLEMS = {
    "wide_any_of": {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(2500)
        ]
    },
    "self_reference": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
}


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_engine(), ServerSettings(model_name="tiny")) as srv:
        yield srv


def chat(schema, **extra) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"model": "tiny", "messages": ASK, "max_tokens": 24, "response_format": fmt, **extra}


# ------------------------------------------------------------------- structured output


@pytest.mark.parametrize("problem", sorted(SCHEMA_PROBLEMS))
def test_a_schema_the_matcher_cannot_follow_is_a_grammar_error_never_stop(server, problem):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat(SCHEMA_PROBLEMS[problem], seed=1, temperature=1.0))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "grammar_error" and error["param"] == "response_format"
        assert "schema" in error["message"] and "<state>" not in error["message"]
        with http.stream(
            "POST", "/v1/chat/completions", json=chat(SCHEMA_PROBLEMS[problem], stream=True)
        ) as s:
            events = sse_events(s)
        finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])]
        assert "stop" not in finishes
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["code"] == "grammar_error"
        # the server still serves structured output afterwards
        ok = http.post("/v1/chat/completions", json=chat({"type": "object"}, max_tokens=4))
        assert ok.status_code == 200


def test_a_stop_output_always_parses(server):
    """A stop string that cuts the JSON short cannot produce a "stop" with output that does not parse."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    }
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for seed in range(4):
            r = http.post(
                "/v1/chat/completions",
                json=chat(schema, stop=['"'], seed=seed, temperature=1.0, max_tokens=40),
            )
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                if choice["finish_reason"] == "stop":
                    json.loads(choice["message"]["content"])
            else:
                assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_error", r.text


# ------------------------------------------------------------------- malformed input


def test_nesting_depth_skips_strings_and_does_not_depend_on_the_stack():
    from cothink.server.socket_routes import MAX_WS_DEPTH, nesting_depth

    assert nesting_depth('{"a": "[[[{{", "b": [1, {"c": "\\"]]]"}]}') == 3  # brackets in strings skipped
    assert nesting_depth("[" * (MAX_WS_DEPTH + 1) + "]" * (MAX_WS_DEPTH + 1)) == MAX_WS_DEPTH + 1
    assert nesting_depth('"[[["') == 0 and nesting_depth("{}") == 1


def test_a_websocket_message_nested_too_deep_gets_an_error_event(server, caplog):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        sid = http.post("/v1/sessions").json()["id"]
        blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "The sky is blue."}).json()["id"]
        url = server.url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ws"
        with caplog.at_level("WARNING", logger="cothink.server"), ws_connect(url, open_timeout=10) as ws:
            ws.send('{"type": "probe", "view": ' + "[" * 1000 + "]" * 1000 + "}")
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["code"] == "too_deep"
            ws.send(json.dumps({"type": "probe", "id": "p", "view": [blk], "question": " Blue? Answer:"}))
            event = json.loads(ws.recv(timeout=30))
            assert event["type"] == "probe" and event["id"] == "p"  # the socket survived
        assert any("nested too deep" in r.getMessage() for r in caplog.records)
        r = http.post(
            f"/v1/sessions/{sid}/generate",
            content=b'{"view": ' + b"[" * 1000 + b"]" * 1000 + b"}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"], r.text


def test_many_stop_strings_and_invalid_utf8_name_the_field(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(5000)]}
        r = http.post("/v1/completions", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "stop" and error["code"], r.text
        sid = http.post("/v1/sessions").json()["id"]
        r = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "x"})
        blk = r.json()["id"]
        gen = {"view": [blk], "max_tokens": 2, "stream": False, "stop": [f"s{i}" for i in range(5000)]}
        r = http.post(f"/v1/sessions/{sid}/generate", json=gen)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "stop" and error["code"], r.text
        raw = b'{"model": "tiny", "prompt": "caf\xe9 \xff", "max_tokens": 2}'
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt" and error["code"], r.text
        raw = b'{"text": "ok \xc3\x28"}'
        r = http.post(f"/v1/sessions/{sid}/blocks", content=raw, headers={"content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "text" and error["code"], r.text
        raw = b'{"text": "ok"}\xff'  # a stray byte outside any string: not JSON
        r = http.post(f"/v1/sessions/{sid}/blocks", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


# ------------------------------------------------------------------- slow clients


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes `sock` within `timeout` (EOF or reset), False if it stays open."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slow_clients_are_closed_and_waiting_connections_are_capped():
    settings = ServerSettings(
        model_name="tiny",
        api_keys=("key-slow-0001",),
        header_timeout_s=0.5,
        body_timeout_s=0.5,
        max_pending_connections=4,
    )
    with running_server(tiny_engine(), settings) as srv:
        head = f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n".encode()
        slow = []
        for _ in range(6):  # partial heads, before any key is checked
            sock = socket.create_connection((srv.host, srv.port))
            sock.sendall(head)
            slow.append(sock)
        body = socket.create_connection((srv.host, srv.port))  # a complete head, then a stalled body
        body.sendall(
            head + b"Authorization: Bearer key-slow-0001\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        # one client more than the cap: the one that waited longest is closed at once, not the newest
        with httpx.Client(
            base_url=srv.url, timeout=10, headers={"Authorization": "Bearer key-slow-0001"}
        ) as http:
            assert http.get("/v1/models").status_code == 200
        # every slow client is closed after its deadline, trickled bytes do not extend it
        for sock in [*slow, body]:
            try:
                sock.sendall(b"X")
            except OSError:
                pass
        assert all(closed_by_server(s, 10) for s in [*slow, body])
        for sock in [*slow, body]:
            sock.close()


# ------------------------------------------------------------------- shutdown


def test_new_requests_during_shutdown_get_503():
    app = create_app(tiny_engine(), ServerSettings(model_name="tiny"))
    server = BackgroundServer(app, timeout_graceful_shutdown=20).start()
    stopper = threading.Thread(target=server.stop, args=(30,))
    try:
        # a request still in flight (its body has not all arrived) keeps the shutdown waiting
        inflight = socket.create_connection((server.host, server.port))
        inflight.sendall(
            f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{".encode()
        )
        assert wait_for(lambda: server.call(lambda: len(server.server.server_state.tasks)) > 0)
        stopper.start()
        assert wait_for(lambda: app.state.cothink.draining)
        with httpx.Client(base_url=server.url, timeout=10) as http:
            r = http.post("/v1/sessions")
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert r.headers["connection"] == "close"
            assert http.get("/health").json()["status"] == "draining"
        inflight.close()
    finally:
        if stopper.ident is None:
            stopper.start()
        stopper.join(30)
    assert not server.thread.is_alive()
