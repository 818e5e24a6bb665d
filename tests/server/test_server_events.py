"""/v1/events: the live event stream's payloads, and its scope (a key sees only its own coroutines)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import pytest
from support import running_server, tiny_engine

from cothink.server import ServerSettings

SETTINGS = ServerSettings(model_name="tiny", api_keys=("alice-key", "bob-key"), admin_keys=("root-key",))


@dataclass(eq=False)
class Listener:
    """Reads /v1/events in a thread; keeps every (event, data) and the raw text."""

    url: str
    key: str | None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    status: int | None = None

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        with httpx.stream("GET", self.url + "/v1/events", headers=headers, timeout=None) as r:
            self.status = r.status_code
            kind = "message"
            for line in r.iter_lines():
                with self.cond:
                    self.raw.append(line)
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        self.events.append((kind, json.loads(line[6:])))
                        self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self.cond:
            return [d for k, d in self.events if k == kind]

    def wait(self, kind: str, test: Callable[[dict[str, Any]], bool] = lambda d: True, timeout: float = 60):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [d for k, d in self.events if k == kind and test(d)]
                if found:
                    return found[-1]
                left = deadline - time.monotonic()
                assert left > 0 and self.thread.is_alive(), f"no {kind!r} event; got {self.events[-5:]}"
                self.cond.wait(left)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_events_payloads_and_scope():
    engine = tiny_engine()
    with running_server(engine, SETTINGS) as server:
        assert httpx.get(server.url + "/v1/events").status_code == 401
        alice, bob, root = (Listener(server.url, k) for k in ("alice-key", "bob-key", "root-key"))
        for listener in (alice, bob, root):
            assert listener.wait("hello")["sees_all"] is (listener is root)
        kv_empty = alice.wait("memory")["kv"]
        http = httpx.Client(base_url=server.url, headers=auth("alice-key"), timeout=60)
        sid = http.post("/v1/sessions", json={"name": "mine"}).json()["id"]
        base = f"/v1/sessions/{sid}"
        ctx = http.post(f"{base}/blocks", json={"name": "ctx", "text": "The quick brown fox"}).json()["id"]
        out = http.post(f"{base}/blocks", json={"name": "out"}).json()["id"]
        body = {"view": [ctx, out], "max_tokens": 1500, "stop_at_eos": False, "background": True}
        gen = http.post(f"{base}/generate", json=body).json()["id"]

        # a generation streams pieces; input lands in a block it reads; a probe answers
        alice.wait("piece", lambda d: d["name"] == gen)
        r = http.post(f"{base}/blocks/{ctx}/extend", json={"text": " jumps over the lazy dog"})
        assert r.status_code == 200, r.text
        probe = http.post(f"{base}/probe", json={"view": [ctx], "question": " Is it a fox?"}).json()
        http.post(f"{base}/coroutines/{gen}/cancel")
        end = alice.wait("end", lambda d: d["name"] == gen)
        final = http.get(f"{base}/coroutines/{gen}").json()

        started = alice.wait("coroutine", lambda d: d["name"] == gen)
        assert started["kind"] == "generate" and started["view"] == [ctx, out] and started["block"] == out
        assert started["session"] == sid and started["labels"] == {ctx: "ctx", out: "out"}
        # cancelled, unless it reached max_tokens first
        assert (end["state"], end["outcome"]) in {("cancelled", "cancelled"), ("done", "length")}
        text = "".join(d["text"] for d in alice.of("piece") if d["name"] == gen)
        assert text and final["text"].startswith(text)
        tokens = sum(d["tokens"] for d in alice.of("piece") if d["name"] == gen)
        assert tokens == final["tokens"]

        extend = alice.wait("input", lambda d: d["block"] == ctx and d["tokens"] > 0)
        assert gen in extend["readers"], "the running generation reads ctx"
        answer = alice.wait("probe", lambda d: d["name"] == probe["coroutine"])
        assert answer["answer"] == pytest.approx(probe["probabilities"], abs=1e-6)
        assert answer["top"] == probe["answer"]

        with alice.cond:
            seqs = [d["seq"] for k, d in alice.events if k not in ("hello", "sessions")]
        assert seqs == sorted(set(seqs)), "each event once, in order"
        steps = alice.of("step")
        assert [s["index"] for s in steps] == sorted(s["index"] for s in steps)
        mine = [c for s in steps for c in s["coroutines"] if c["name"] == gen]
        assert mine and all(c["decode"] == 1 and c["prefill"] == 0 for c in mine)
        assert any(c["prefill"] > 0 for s in steps for c in s["coroutines"] if c["name"] == extend["name"])
        assert all(s["duration_ms"] >= 0 for s in steps)

        blocks = alice.wait("sessions", lambda d: any(s["id"] == sid for s in d["sessions"]))["sessions"][0]
        assert {b["name"] for b in blocks["blocks"]} == {"ctx", "out"}
        grown = alice.wait("memory", lambda d: d["kv"] > kv_empty)
        assert grown["kv_total"] >= grown["kv"] and grown["budget"] is None
        http.delete(f"{base}")  # releases both blocks: the gauges fall back
        alice.wait("memory", lambda d: d["kv"] < grown["kv"])
        alice.wait("sessions", lambda d: d["sessions"] == [])

        # the admin sees alice's coroutines; bob sees none of them, only the load as "others"
        root.wait("end", lambda d: d["name"] == gen)
        bob.wait("step", lambda d: d["index"] >= steps[-1]["index"])
        with bob.cond:
            leaked = [line for line in bob.raw if gen in line or sid in line or ctx in line]
        assert not leaked
        assert not bob.of("coroutine") and not bob.of("piece") and not bob.of("probe")
        assert {c["name"] for s in bob.of("step") for c in s["coroutines"]} == {"others"}
        assert all(d["sessions"] == [] for d in bob.of("sessions"))
    for listener in (alice, bob, root):
        listener.thread.join(10)
        assert not listener.thread.is_alive(), "the stream ends when the server shuts down"


def test_without_keys_ids_show_only_where_sessions_may_be_listed():
    engine = tiny_engine()
    with running_server(engine, ServerSettings(model_name="tiny")) as server:
        anyone = Listener(server.url, None)
        assert anyone.wait("hello")["sees_all"] is False
        http = httpx.Client(base_url=server.url, timeout=60)
        sid = http.post("/v1/sessions").json()["id"]
        blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "abc"}).json()["id"]
        gen = http.post(
            f"/v1/sessions/{sid}/generate", json={"view": [blk], "max_tokens": 3, "stream": False}
        )
        assert gen.status_code == 200
        anyone.wait("step", lambda d: d["decode"] > 0)
        anyone.wait("memory", lambda d: d["kv"] > 0)
        with anyone.cond:
            assert not [line for line in anyone.raw if sid in line or blk in line or "co_" in line]
        assert {c["name"] for s in anyone.of("step") for c in s["coroutines"]} == {"others"}
    anyone.thread.join(10)


def test_events_replay_history_and_console_is_open():
    engine = tiny_engine()
    settings = ServerSettings(model_name="tiny", list_sessions_without_key=True)
    with running_server(engine, settings) as server:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200
        late = Listener(server.url, None)  # opened after the request: the history comes first
        started = late.wait("coroutine", lambda d: d["kind"] == "generate" and d.get("replay"))
        assert started["name"].startswith("chatcmpl-") and started["priority"] == "interactive"
        assert late.wait("hello")["sees_all"], "where sessions may be listed, the stream shows them all"
        page = httpx.get(server.url + "/console")
        assert page.status_code == 200 and "data-timeline" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert (
            httpx.get(server.url + "/console/console.js")
            .headers["content-type"]
            .startswith("text/javascript")
        )
    late.thread.join(10)
