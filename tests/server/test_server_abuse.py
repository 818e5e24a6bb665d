"""Isolation and abuse, each against a real uvicorn server on loopback: what one client can see of
another, quotas, expiry, requests that can never fit, size limits, disconnects and the event loop.

The model is the tiny random-weight Llama with SmolLM2's tokenizer (tests/support.py).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from support import abandoned_request, running_server, tiny_engine, wait_for
from websockets.sync.client import connect as ws_connect

from cothink.server import ServerSettings

KEY_A, KEY_B, ADMIN = "key-a-abuse-0001", "key-b-abuse-0002", "key-admin-abuse-03"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ws_url(server, session_id: str) -> str:
    return server.url.replace("http://", "ws://") + f"/v1/sessions/{session_id}/ws"


def live_blocks(server) -> int:
    return server.call(lambda: server.app.state.cothink.engine.memory().live_blocks)


# ------------------------------------------------------------------- no-key mode enumerates nothing


def test_without_keys_nothing_lists_other_clients_sessions():
    with running_server(tiny_engine(), ServerSettings(model_name="tiny")) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as alice, httpx.Client(base_url=srv.url) as mallory:
            sid = alice.post("/v1/sessions").json()["id"]
            blk = alice.post(f"/v1/sessions/{sid}/blocks", json={"text": "my secret"}).json()["id"]
            body = {"view": [blk], "max_tokens": 3, "stream": False}
            r = alice.post(f"/v1/sessions/{sid}/generate", json=body)
            coroutine = r.json()["coroutine"]
            listing = mallory.get("/v1/sessions")
            assert listing.status_code == 403 and listing.json()["error"]["code"] == "listing_disabled"
            assert sid not in listing.text
            # the timeline shows the load but not whose: no session coroutine ids without a key
            timeline = mallory.get("/v1/timeline").text
            assert coroutine not in timeline and sid not in timeline and "others" in timeline
            # the creator still reaches the session through the id it was given
            assert alice.get(f"/v1/sessions/{sid}/blocks/{blk}").json()["text"].startswith("my secret")


# ------------------------------------------------------------------- Host and Origin


def test_host_and_origin_are_checked():
    settings = ServerSettings(model_name="tiny", allowed_origins=("http://app.example",))
    with running_server(tiny_engine(), settings) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            r = http.get("/v1/models", headers={"Host": "attacker.example"})  # DNS rebinding
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
            assert http.get("/v1/models", headers={"Host": f"localhost:{srv.port}"}).status_code == 200
            r = http.get("/v1/models", headers={"Origin": "http://attacker.example"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
            ok = http.get("/v1/models", headers={"Origin": "http://app.example"})
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == "http://app.example"
            sid = http.post("/v1/sessions").json()["id"]
        with pytest.raises(Exception):
            with ws_connect(ws_url(srv, sid), open_timeout=10, origin="http://attacker.example") as ws:
                ws.recv(timeout=5)
    exposed = ServerSettings(model_name="tiny", bind_host="0.0.0.0", allowed_hosts=("api.example",))
    with running_server(tiny_engine(), exposed) as srv, httpx.Client(base_url=srv.url) as http:
        assert http.get("/v1/models", headers={"Host": "api.example"}).status_code == 200
        assert http.get("/v1/models").status_code == 403  # 127.0.0.1 is not in the list


# ------------------------------------------------------------------- idle state cannot pin memory


def test_one_key_cannot_pin_the_pool_with_idle_blocks():
    engine = tiny_engine(kv_tokens=1024, page_size=16, pool_wait_s=3)  # 64 pages
    settings = ServerSettings(
        model_name="tiny", api_keys=(KEY_A, KEY_B), session_max_blocks=1000, memory_pressure=0.3
    )
    with running_server(engine, settings) as srv:
        with httpx.Client(base_url=srv.url, headers=auth(KEY_A), timeout=30) as a:
            sid = a.post("/v1/sessions").json()["id"]
            made, refusal = 0, None
            for _ in range(200):  # one-token blocks: each costs a page, not a token
                r = a.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": [5]})
                if r.status_code != 201:
                    refusal = r
                    break
                made += 1
            assert refusal is not None and refusal.status_code == 429
            assert refusal.json()["error"]["code"] == "key_memory_quota"
            assert made == 32  # half the pool's pages (two keys)
            info = a.get(f"/v1/sessions/{sid}").json()
            assert info["usage"]["pages"] == 32 and info["limits"]["key_max_pages"] == 32
            health = httpx.get(srv.url + "/health").json()
            assert health["status"] == "memory_pressure" and health["memory"]["used_pages"] >= 32
        # the other key is served while key A still holds its pages: it does not wait for memory
        # that never frees
        with httpx.Client(base_url=srv.url, headers=auth(KEY_B), timeout=30) as b:
            r = b.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            assert httpx.get(srv.url + "/health").json()["memory"]["used_pages"] >= 32


def test_sessions_and_blocks_expire_and_keys_have_a_session_cap():
    settings = ServerSettings(
        model_name="tiny", api_keys=(KEY_A, KEY_B), session_idle_s=0.4, block_idle_s=0.4, key_max_sessions=2
    )
    with running_server(tiny_engine(), settings) as srv:
        with httpx.Client(base_url=srv.url, headers=auth(KEY_A), timeout=30) as a:
            baseline = live_blocks(srv)
            s1 = a.post("/v1/sessions").json()["id"]
            a.post(f"/v1/sessions/{s1}/blocks", json={"text": "idle"})
            s2 = a.post("/v1/sessions").json()["id"]
            r = a.post("/v1/sessions")
            assert r.status_code == 429 and r.json()["error"]["code"] == "key_session_limit"
            # key B still gets sessions: one key cannot take every slot
            assert httpx.post(srv.url + "/v1/sessions", headers=auth(KEY_B)).status_code == 201
            # s2 stays in use (each request refreshes it); s1 is idle and goes, with its memory
            keep = a.post(f"/v1/sessions/{s2}/blocks", json={"text": "kept"}).json()["id"]
            for _ in range(10):
                time.sleep(0.1)
                assert a.get(f"/v1/sessions/{s2}/blocks/{keep}").status_code == 200
            assert a.get(f"/v1/sessions/{s1}").status_code == 404
            sessions = srv.app.state.cothink.sessions.sessions
            assert wait_for(lambda: srv.call(lambda: s2 not in sessions), 5)
            assert wait_for(lambda: live_blocks(srv) == baseline, 5)


# ------------------------------------------------------------------- a request that can never fit


def test_a_request_that_can_never_fit_is_refused_at_once():
    engine = tiny_engine(kv_tokens=1024, page_size=16)  # 64 pages; prompts of 500 tokens need 33 each
    with running_server(engine, ServerSettings(model_name="tiny")) as srv:
        before, steps = live_blocks(srv), srv.call(lambda: engine.steps)
        body = {"model": "tiny", "prompt": [[7] * 500 for _ in range(8)], "max_tokens": 16}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert srv.call(lambda: engine.steps) == steps  # refused at admission: not one forward pass
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "exceeds_memory_budget"
        assert "264 KV pages" in err["message"] and "64 pages" in err["message"]
        assert live_blocks(srv) == before  # nothing was allocated or prefilled
        # the same prompts, two at a time, fit: admission is per request, as a unit
        body["prompt"] = body["prompt"][:1]
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200


# ------------------------------------------------------------------- size limits on every transport


def test_websocket_messages_have_the_body_limit_and_binary_frames_are_errors():
    settings = ServerSettings(model_name="tiny", max_body_bytes=64 * 1024)
    with running_server(tiny_engine(), settings) as srv, httpx.Client(base_url=srv.url) as http:
        sid = http.post("/v1/sessions").json()["id"]
        created = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "The sky is blue."}).json()
        blk, length = created["id"], created["length"]
        with ws_connect(ws_url(srv, sid), open_timeout=10, max_size=None) as ws:
            huge = json.dumps({"type": "extend", "id": "big", "block": blk, "text": "a" * (2 << 20)})
            ws.send(huge)
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["code"] == "body_too_large"
            assert http.get(f"/v1/sessions/{sid}/blocks/{blk}").json()["length"] == length  # nothing written
            ws.send(b"\x00\x01binary")
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["code"] == "invalid_message"
            ws.send(json.dumps({"type": "probe", "id": "p", "view": [blk], "question": " Blue? Answer:"}))
            event = json.loads(ws.recv(timeout=30))
            assert event["type"] == "probe" and event["id"] == "p"  # the socket survived both


def test_tokenizing_a_large_input_does_not_block_the_event_loop():
    engine = tiny_engine(max_context=1 << 21)  # so that only tokenizing can tell the input is too long
    settings = ServerSettings(model_name="tiny", max_body_bytes=8 << 20)
    with running_server(engine, settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        result: dict = {}

        def big_block() -> None:
            text = "Hello world, this is some text. " * 80_000  # 2.5 MB, ~600k tokens
            with httpx.Client(base_url=srv.url, timeout=60) as other:
                result["r"] = other.post(f"/v1/sessions/{sid}/blocks", json={"text": text})

        worker = threading.Thread(target=big_block)
        worker.start()
        time.sleep(0.3)
        answered_during = 0  # /health calls answered while the big request was still being served
        while worker.is_alive():
            assert http.get("/health").status_code in (200, 503)
            answered_during += worker.is_alive()
            time.sleep(0.05)
        worker.join()
        assert result["r"].status_code == 413  # it could never fit the pool: refused after tokenizing
        # a loop blocked by the tokenizer would answer at most the one call that waited behind it
        assert answered_during >= 3, answered_during


def test_texts_longer_than_the_context_are_refused_before_tokenizing():
    settings = ServerSettings(model_name="tiny", max_body_bytes=8 << 20)
    with running_server(tiny_engine(), settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        r = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "x" * (6 << 20)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # refused by its character count (each token covers a bounded number of characters)
        assert r.json()["error"]["param"] == "text" and "characters: at least" in r.json()["error"]["message"]


# ------------------------------------------------------------------- a disconnect aborts the prefill


def _prefilled(app, name_prefix: str) -> int:
    """Prompt tokens prefilled so far by coroutines whose name starts with `name_prefix` (call on the
    server's event loop)."""
    return sum(
        i.tokens
        for r in app.state.cothink.engine.timeline
        for i in r.items
        if i.coroutine.startswith(name_prefix) and i.kind == "extend"
    )


def _prefilled_tokens(srv, name_prefix: str) -> int:
    return srv.call(_prefilled, srv.app, name_prefix)


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_during_prefill_stops_the_work(stream):
    engine = tiny_engine(max_prefill_chunk=1)  # 1900 tokens: 1900 steps
    with running_server(engine, ServerSettings(model_name="tiny")) as srv:
        before = live_blocks(srv)
        body = {"model": "tiny", "prompt": [9] * 1900, "max_tokens": 8, "stream": stream}
        abandoned_request(srv, "/v1/completions", body, lambda: _prefilled(srv.app, "cmpl-") > 0)
        assert wait_for(lambda: live_blocks(srv) == before, 5)
        settled = _prefilled_tokens(srv, "cmpl-")
        time.sleep(0.3)
        assert _prefilled_tokens(srv, "cmpl-") == settled  # nothing more ran after the release
        assert settled < 1900  # the prefill stopped when the client left


def test_a_disconnect_during_a_session_extend_stops_the_work():
    engine = tiny_engine(max_prefill_chunk=1)  # 1900 steps
    settings = ServerSettings(model_name="tiny")
    with running_server(engine, settings) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        sid = http.post("/v1/sessions").json()["id"]
        blk = http.post(f"/v1/sessions/{sid}/blocks").json()["id"]
        body = {"token_ids": [9] * 1900, "name": "gone"}
        path = f"/v1/sessions/{sid}/blocks/{blk}/extend"
        abandoned_request(srv, path, body, lambda: _prefilled(srv.app, ""))
        coroutines = lambda: http.get(f"/v1/sessions/{sid}/coroutines").json()["data"]  # noqa: E731
        assert wait_for(lambda: all(c["status"] != "running" for c in coroutines()), 5)
        (co,) = [c for c in coroutines() if c["name"] == "gone"]
        assert co["status"] == "failed" and co["error"] == "cancelled"
        settled = _prefilled_tokens(srv, co["id"])
        time.sleep(0.3)
        assert _prefilled_tokens(srv, co["id"]) == settled < 1900


# ------------------------------------------------------------------- quota checks reserve atomically


def test_concurrent_extends_cannot_bypass_the_session_quota():
    settings = ServerSettings(model_name="tiny", session_max_tokens=3000, session_max_blocks=64)
    with running_server(tiny_engine(), settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        blocks = [http.post(f"/v1/sessions/{sid}/blocks").json()["id"] for _ in range(16)]
        statuses: list[int] = []

        def extend(block: str) -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                r = c.post(f"/v1/sessions/{sid}/blocks/{block}/extend", json={"token_ids": [11] * 1000})
                statuses.append(r.status_code)

        threads = [threading.Thread(target=extend, args=(b,)) for b in blocks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert statuses.count(200) <= 3 and statuses.count(429) >= 13, statuses
        assert http.get(f"/v1/sessions/{sid}").json()["usage"]["tokens"] <= 3000


# ------------------------------------------------------------ bad input is a 400 naming the field


@pytest.fixture(scope="module")
def plain():
    with running_server(tiny_engine(), ServerSettings(model_name="tiny", max_tokens_per_request=4096)) as srv:
        yield srv


def _post(http: httpx.Client, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
            "messages.0.content",
        ),
        ("/v1/chat/completions", '{"model": "x\\ud800", "messages": [], "max_tokens": 2}', "model"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "max_tokens": "10"}', "max_tokens"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "max_tokens": true}', "max_tokens"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "stream": "yes"}', "stream"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": 5}', "stop"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "temperature": "0"}', "temperature"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "max_tokens": 2048}', "max_tokens"),
        ("/v1/completions", '{"model": "tiny", "prompt": [1, 2', None),
    ],
)
def test_bad_requests_are_400_naming_the_field(plain, path, raw, param):
    with httpx.Client(base_url=plain.url, timeout=30) as http:
        r = _post(http, path, raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        assert http.get("/v1/models").status_code == 200  # the keep-alive connection survives


def test_prompt_plus_max_tokens_beyond_the_context_is_context_length_exceeded(plain):
    r = httpx.post(
        plain.url + "/v1/completions", json={"model": "tiny", "prompt": [5] * 100, "max_tokens": 2000}
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "2100" in err["message"]


def test_session_api_bad_unicode_and_empty_view_are_400(plain):
    with httpx.Client(base_url=plain.url, timeout=30) as http:
        sid = http.post("/v1/sessions").json()["id"]
        blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "ok"}).json()["id"]
        r = _post(http, f"/v1/sessions/{sid}/blocks", '{"text": "\\ud800"}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"
        r = http.post(f"/v1/sessions/{sid}/blocks/{blk}/extend", json={"text": "x", "view": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "view"
        with ws_connect(ws_url(plain, sid), open_timeout=10) as ws:
            ws.send('{"type": "extend", "block": "%s", "text": "\\ud800"}' % blk)
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["param"] == "text"
            ws.send('{"type": "generate", "view": ["%s"], "max_tokens": "3"}' % blk)
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["param"] == "max_tokens"
        assert http.get(f"/v1/sessions/{sid}/blocks/{blk}").json()["text"] == "ok"


# ------------------------------------------------------------------- the timeline is per key


def test_timeline_shows_only_the_callers_coroutines_unless_admin():
    settings = ServerSettings(model_name="tiny", api_keys=(KEY_A, KEY_B), admin_keys=(ADMIN,))
    with running_server(tiny_engine(), settings) as srv:
        names = {}
        for key in (KEY_A, KEY_B):
            with httpx.Client(base_url=srv.url, headers=auth(key), timeout=30) as http:
                sid = http.post("/v1/sessions").json()["id"]
                blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "Hi"}).json()["id"]
                body = {"view": [blk], "max_tokens": 2, "stream": False}
                names[key] = http.post(f"/v1/sessions/{sid}/generate", json=body).json()["coroutine"]

        def lanes(key: str) -> set[str]:
            trace = httpx.get(srv.url + "/v1/timeline", headers=auth(key)).json()
            return {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}

        assert names[KEY_B] in lanes(KEY_B) and names[KEY_A] not in lanes(KEY_B) and "others" in lanes(KEY_B)
        assert names[KEY_A] in lanes(KEY_A) and names[KEY_B] not in lanes(KEY_A)
        assert {names[KEY_A], names[KEY_B]} <= lanes(ADMIN)
