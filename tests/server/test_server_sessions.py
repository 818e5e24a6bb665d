"""The session API on a real loopback server (tiny random-weight Llama with the SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from support import abandoned_request, running_server, sse_events, tiny_engine
from websockets.sync.client import connect as ws_connect

from cothink.client import Client, ClientError
from cothink.server import ServerSettings

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(
        model_name="tiny",
        api_keys=(KEY_A, KEY_B),
        max_body_bytes=64 * 1024,
        max_tokens_per_request=512,
        session_max_blocks=8,
        session_max_tokens=1000,
    )
    with running_server(tiny_engine(), settings) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as c:
        yield c


@pytest.fixture
def client(server):
    with Client(server.url, api_key=KEY_A) as c:
        yield c


def ws_url(server, session_id: str) -> str:
    return server.url.replace("http://", "ws://") + f"/v1/sessions/{session_id}/ws"


# ---------------------------------------------------------------------------------------- blocks


def test_block_lifecycle(client):
    with client.session("lifecycle") as s:
        a = s.block("The sky is")
        assert a.length > 0 and a.text == "The sky is"
        b = s.block(token_ids=[1, 2, 3], name="ids")
        assert b.length == 3 and b.name == "ids"
        a2 = s.extend(a, " blue")
        assert a2.length > a.length and a2.text == "The sky is blue"
        a3 = s.extend(a, token_ids=[42, 43], view=[b, a])
        assert a3.length == a2.length + 2
        fork = s.fork(a, name="copy")
        assert fork.length == a3.length and fork.id != a.id
        assert s.truncate(a, 2).length == 2
        assert s.get_block(fork, token_ids=True).token_ids[-2:] == [42, 43]  # the fork kept its tokens
        listed = {blk.id: blk for blk in s.blocks()}
        assert set(listed) == {a.id, b.id, fork.id}
        assert listed[a.id].length == 2 and listed[fork.id].length == a3.length
        s.delete_block(b)
        assert {blk.id for blk in s.blocks()} == {a.id, fork.id}
        with pytest.raises(ClientError) as err:
            s.get_block(b)
        assert err.value.status == 404 and err.value.code == "block_not_found"
        kinds = [c["kind"] for c in s.coroutines()]
        assert kinds.count("extend") == 4  # two initial writes and two extends
        assert all(c["status"] == "finished" for c in s.coroutines())


def test_ids_are_unguessable(client):
    with client.session() as s:
        blk = s.block()
        assert s.id.startswith("sess_") and len(s.id) >= 20
        assert blk.id.startswith("blk_") and len(blk.id) >= 20


# ---------------------------------------------------------------------------------------- generation


def test_generate_streams_events_over_a_view(client):
    with client.session() as s:
        prompt, out = s.block("Once upon a time"), s.block()
        events = list(s.stream([prompt, out], max_tokens=5))
        assert events[0]["type"] == "start" and events[0]["view"] == [prompt.id, out.id]
        assert events[-1]["type"] == "end" and events[-1]["finish_reason"] == "length"
        tokens = [t for e in events if e["type"] == "token" for t in e["token_ids"]]
        assert tokens == events[-1]["token_ids"] and len(tokens) == 5
        assert "".join(e["text"] for e in events if e["type"] == "token") == events[-1]["text"]
        assert events[-1]["usage"] == {
            "prompt_tokens": prompt.length,
            "completion_tokens": 5,
            "total_tokens": prompt.length + 5,
        }
        # the output stays in the block; a greedy rerun from the same state gives the same tokens
        assert s.get_block(out, token_ids=True).token_ids == tokens
        s.truncate(out, 0)
        again = s.generate([prompt, out], max_tokens=5)
        assert again["token_ids"] == tokens and again["finish_reason"] == "length"


def test_background_generation_cancel_and_listing(client):
    with client.session() as s:
        prompt, out = s.block("Count:"), s.block()
        co = s.start([prompt, out], max_tokens=500)
        assert co["status"] == "running" and co["kind"] == "generate"
        deadline = time.monotonic() + 30
        while s.coroutine(co["id"])["tokens"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        running = s.coroutines(status="running")
        assert [c["id"] for c in running] == [co["id"]]
        # writing into a block someone is writing: 409
        with pytest.raises(ClientError) as err:
            s.extend(out, "x")
        assert err.value.status == 409 and err.value.code == "block_busy"
        info = s.cancel(co["id"])
        assert info["status"] == "finished" and info["finish_reason"] == "cancelled"
        assert 2 <= info["tokens"] < 500
        assert s.get_block(out).length == info["tokens"]  # what it wrote stays
        assert s.coroutines(status="running") == []
        assert s.cancel(co["id"])["finish_reason"] == "cancelled"  # idempotent


def test_client_disconnect_cancels_and_releases(server, client):
    state = server.app.state.cothink
    # blocks of requests (the prefix cache keeps a fork of each chat prompt it saw, by design)
    engine_blocks = lambda: server.call(  # noqa: E731
        lambda: state.engine.memory().live_blocks - len(state.prefix_cache.entries)
    )
    with client.session() as s:
        prompt, out = s.block("Tell me everything:"), s.block()
        baseline = engine_blocks()
        headers = {"Authorization": f"Bearer {KEY_A}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            body = {"view": [prompt.id, out.id], "max_tokens": 100_000 // 200, "stop_at_eos": False}
            with http.stream("POST", f"/v1/sessions/{s.id}/generate", json=body) as r:
                lines = r.iter_lines()
                first = [next(lines) for _ in range(3)]
            coroutine = json.loads(first[0][6:])["coroutine"]
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500,
                "stream": True,
            }
            with http.stream("POST", "/v1/chat/completions", json=chat) as r:
                next(r.iter_lines())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = s.coroutine(coroutine)
            if info["status"] != "running" and engine_blocks() == baseline:
                break
            time.sleep(0.05)
        assert info["status"] == "finished" and info["finish_reason"] == "cancelled"
        assert engine_blocks() == baseline  # the chat request's blocks went back too
        assert s.get_block(out).length == info["tokens"] < 500
        # a non-streaming request whose client gives up is cancelled as well. The test pauses the
        # generation server-side as soon as it exists, so it cannot finish before the client leaves
        # however fast the machine is; the disconnect must cancel it while paused.
        session = server.call(lambda: state.sessions.sessions[s.id])

        def pause_impatient() -> bool:
            mine = [c for c in session.coroutines.values() if c.name == "impatient"]
            if mine and mine[0].generation is not None:
                mine[0].generation.pause()
                return True
            return False

        body = {
            "view": [prompt.id, out.id],
            "max_tokens": 500,
            "stream": False,
            "stop_at_eos": False,
            "name": "impatient",
        }
        path = f"/v1/sessions/{s.id}/generate"
        abandoned_request(server, path, body, pause_impatient, {"Authorization": f"Bearer {KEY_A}"})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            mine = [c for c in s.coroutines() if c["name"] == "impatient"]
            if mine and mine[0]["status"] != "running":
                break
            time.sleep(0.05)
        assert mine[0]["finish_reason"] == "cancelled" and mine[0]["tokens"] < 500


def test_probe(client):
    with client.session() as s:
        ctx = s.block("The sky is blue.")
        probs = s.probe([ctx], " Is the sky blue? Answer:")
        assert set(probs) == {" yes", " no"} and abs(sum(probs.values()) - 1) < 1e-6
        three = s.probe(ctx, [5, 6, 7], choices=["a", "b", " c d"])
        assert set(three) == {"a", "b", " c d"}
        assert s.get_block(ctx).length == ctx.length  # probes write nothing


def test_websocket_duplex_extend_and_cancel(server, client):
    with client.session() as s:
        news, out = s.block("News:"), s.block()
        headers = {"Authorization": f"Bearer {KEY_A}"}
        with ws_connect(ws_url(server, s.id), additional_headers=headers, open_timeout=10) as ws:
            ws.send(
                json.dumps({"type": "generate", "id": "g1", "view": [news.id, out.id], "max_tokens": 400})
            )
            seen: list[dict] = []
            extended = cancelled = False
            while True:
                event = json.loads(ws.recv(timeout=30))
                seen.append(event)
                tokens = sum(1 for e in seen if e["type"] == "token")
                if tokens == 3 and not extended:  # input arrives while the generation runs
                    ws.send(
                        json.dumps({"type": "extend", "id": "x1", "block": news.id, "text": " more news"})
                    )
                    extended = True
                if event["type"] == "extended":
                    assert event["id"] == "x1" and event["block"] == news.id and event["length"] > news.length
                    ws.send(json.dumps({"type": "cancel", "id": "c1"}))
                if event["type"] == "cancelled":
                    cancelled = True
                if event["type"] == "end":
                    break
            assert seen[0]["type"] == "start" and seen[0]["id"] == "g1"
            assert cancelled and seen[-1]["finish_reason"] == "cancelled" and seen[-1]["id"] == "g1"
            # bad messages get an error event, not a closed socket
            ws.send("not json")
            assert json.loads(ws.recv(timeout=10))["type"] == "error"
            ws.send(json.dumps({"type": "probe", "id": "p", "view": [news.id], "question": " ok? Answer:"}))
            reply = json.loads(ws.recv(timeout=30))
            assert (
                reply["type"] == "probe"
                and reply["id"] == "p"
                and set(reply["probabilities"]) == {" yes", " no"}
            )


# ---------------------------------------------------------------------------------------- errors


def test_errors_are_json_4xx(http, client):
    s = client.session()
    blk = s.block("hello")
    base = f"/v1/sessions/{s.id}"

    def check(response: httpx.Response, status: int, code: str | None = None) -> dict:
        assert response.status_code == status, response.text
        err = response.json()["error"]
        assert err["message"] and err["type"]
        if code:
            assert err["code"] == code, err
        return err

    check(
        http.post(
            f"{base}/blocks/{blk.id}/extend",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        ),
        400,
    )
    check(http.post(f"{base}/blocks/{blk.id}/extend", json={"text": "a", "token_ids": [1]}), 400)
    check(http.post(f"{base}/blocks/{blk.id}/extend", json={"text": ""}), 400, "empty_input")
    check(http.post(f"{base}/blocks/{blk.id}/extend", json={"token_ids": [10**6]}), 400, "invalid_token_id")
    check(http.post(f"{base}/blocks/{blk.id}/extend", json={"token_ids": [-1]}), 400)
    check(http.post(f"{base}/blocks/{blk.id}/truncate", json={"length": 999}), 400)
    check(http.post(f"{base}/generate", json={"view": [blk.id, "blk_nope"]}), 404, "block_not_found")
    check(http.post(f"{base}/generate", json={"view": [blk.id, blk.id]}), 400, "invalid_view")
    check(
        http.post(f"{base}/generate", json={"view": [blk.id], "max_tokens": 100_000}),
        400,
        "max_tokens_too_large",
    )
    check(http.post(f"{base}/generate", json={"view": []}), 400)
    empty = s.block()
    check(
        http.post(f"{base}/generate", json={"view": [empty.id], "max_tokens": 1, "stream": False}),
        400,
        "empty_input",
    )
    check(http.post(f"{base}/probe", json={"view": [blk.id], "question": "q", "choices": ["a", "a"]}), 400)
    check(http.post(f"{base}/coroutines/co_nope/cancel"), 404, "coroutine_not_found")
    check(http.get("/v1/nope"), 404)
    check(
        http.post(f"{base}/blocks", content=b"x" * (65 * 1024), headers={"Content-Type": "application/json"}),
        413,
        "body_too_large",
    )
    s.delete()


def test_session_quotas(client):
    with client.session() as s:
        blocks = [s.block() for _ in range(8)]
        with pytest.raises(ClientError) as err:
            s.block()
        assert err.value.status == 429 and err.value.code == "session_block_quota"
        s.delete_block(blocks[0])
        s.block()  # room again
        with pytest.raises(ClientError) as err:
            s.extend(blocks[1], token_ids=[7] * 1001)
        assert err.value.status == 429 and err.value.code == "session_token_quota"
        s.extend(blocks[1], token_ids=[7] * 600)
        with pytest.raises(ClientError) as err:
            s.generate([blocks[1]], max_tokens=450)  # 600 held + 450 reserved > 1000
        assert err.value.status == 429 and err.value.code == "session_token_quota"
        assert s.generate([blocks[1]], max_tokens=2)["finish_reason"] in ("stop", "length")


def test_engine_errors_map_to_4xx_5xx():
    engine = tiny_engine(kv_tokens=64, page_size=16, on_pool_full="error", max_input_tokens=50)
    with running_server(engine, ServerSettings(model_name="tiny")) as srv, Client(srv.url) as c:
        s = c.session()
        with pytest.raises(ClientError) as err:
            s.block(token_ids=[3] * 101)  # more than the whole 4-page pool: refused before any prefill
        assert err.value.status == 413 and err.value.code == "exceeds_memory_budget"
        assert "7 KV pages" in err.value.message and "4 pages" in err.value.message
        with pytest.raises(ClientError) as err:
            s.block(token_ids=[3] * 51)  # over the engine's max_input_tokens
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
        s.block(token_ids=[3] * 50)  # the 64-token pool is full now
        other = c.session()  # without keys each session is its own account: the pool is the limit
        with pytest.raises(ClientError) as err:
            other.block(token_ids=[4] * 20)
        assert err.value.status == 503 and err.value.code == "pool_exhausted"
        r = httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": [5] * 20, "max_tokens": 2}
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert len(s.blocks()) == 1 and other.blocks() == []  # failed creations left nothing behind


# ---------------------------------------------------------------------------------------- isolation and auth


def test_sessions_are_isolated(server, client):
    with client.session() as mine, client.session() as other:
        secret = mine.block("my secret")
        paths = [
            ("GET", f"/v1/sessions/{other.id}/blocks/{secret.id}"),
            ("POST", f"/v1/sessions/{other.id}/blocks/{secret.id}/extend"),
            ("POST", f"/v1/sessions/{other.id}/blocks/{secret.id}/fork"),
            ("DELETE", f"/v1/sessions/{other.id}/blocks/{secret.id}"),
        ]
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
            for method, path in paths:
                body = {"text": "x"} if path.endswith("extend") else None
                r = http.request(method, path, json=body)
                assert r.status_code == 404 and "secret" not in r.text, (method, path, r.text)
            r = http.post(f"/v1/sessions/{other.id}/generate", json={"view": [secret.id], "stream": False})
            assert r.status_code == 404
            assert secret.id not in {b.id for b in other.blocks()}
        # another API key does not see the session at all
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_B}"}) as http_b:
            for path in (
                f"/v1/sessions/{mine.id}",
                f"/v1/sessions/{mine.id}/blocks",
                f"/v1/sessions/{mine.id}/blocks/{secret.id}",
                f"/v1/sessions/{mine.id}/coroutines",
            ):
                assert http_b.get(path).status_code == 404
            assert http_b.delete(f"/v1/sessions/{mine.id}").status_code == 404
            assert mine.id not in [x["id"] for x in http_b.get("/v1/sessions").json()]
        assert mine.get_block(secret).text == "my secret"  # untouched


def test_auth_required_except_health(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/v1/sessions"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/timeline"),
        ]:
            r = http.request(method, path)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
            r = http.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = http.request(method, path, headers={"Authorization": f"Basic {KEY_A}"})
            assert r.status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
    with pytest.raises(Exception):
        with ws_connect(ws_url(server, "sess_x"), open_timeout=10):
            pass


# ---------------------------------------------------------------------------------------- shutdown


def test_graceful_shutdown_ends_streams_with_a_finish_reason():
    from support import running_server as run

    engine = tiny_engine()
    settings = ServerSettings(model_name="tiny", max_tokens_per_request=100_000)
    events: list = []
    chat: list = []
    ws_events: list = []
    with run(engine, settings) as srv:
        c = Client(srv.url)
        s = c.session()
        prompt, out = s.block("Go on:"), s.block()
        started, ws_started, chat_started = threading.Event(), threading.Event(), threading.Event()

        def consume_session():
            for event in s.stream([prompt, out], max_tokens=1_900):
                events.append(event)
                if event["type"] == "token":
                    started.set()

        def consume_chat():
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                with http.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1_900,
                        "stream": True,
                    },
                ) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            chat.append(line)
                            chat_started.set()

        def consume_socket():
            ws_out = s.block()
            try:
                with ws_connect(ws_url(srv, s.id), open_timeout=10) as ws:
                    msg = {"type": "generate", "view": [prompt.id, ws_out.id], "max_tokens": 1_900}
                    ws.send(json.dumps(msg))
                    while True:
                        ws_events.append(json.loads(ws.recv(timeout=30)))
                        if ws_events[-1]["type"] == "token":
                            ws_started.set()
            except Exception as exc:  # the server closes the socket after the end event
                ws_events.append({"type": "closed", "error": repr(exc)})

        threads = [threading.Thread(target=t) for t in (consume_session, consume_chat, consume_socket)]
        for t in threads:
            t.start()
        # shut down once every stream is generating
        assert started.wait(60) and ws_started.wait(60) and chat_started.wait(60), ws_events
        assert srv.stop(60)  # returns once the server thread ended
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        c.close()
    assert events[-1]["type"] == "end" and events[-1]["finish_reason"] == "cancelled", events[-1]
    assert chat[-1] == "data: [DONE]"
    last = json.loads(chat[-2][6:])
    assert last["choices"][0]["finish_reason"] == "cancelled"
    assert [e["type"] for e in ws_events if e["type"] in ("start", "end")] == ["start", "end"]
    assert [e for e in ws_events if e["type"] == "end"][0]["finish_reason"] == "cancelled"
    assert not engine.running


def test_health_and_sse_parsing(server):
    with httpx.Client(base_url=server.url) as http:
        body = http.get("/health").json()
        assert body["status"] == "ok" and body["engine_running"] is True
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "abc"}).json()["id"]
        r = http.post(f"/v1/sessions/{sid}/generate", json={"view": [blk], "max_tokens": 2})
        assert r.headers["content-type"].startswith("text/event-stream")
        kinds = [e["type"] for e in sse_events(r)]
        assert kinds[0] == "start" and kinds[-1] == "end"
