"""The live console in a real browser, against a real `cothink serve` with SmolLM2.

One server for the module (keys alice, bob and the admin root); the last test restarts it in place.
"""

from __future__ import annotations

import re
import threading

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.timeout(300)

KV_ABOVE = """n => +document.querySelector('[data-gauge="kv"]').dataset.bytes > n"""
KV_BELOW = """n => +document.querySelector('[data-gauge="kv"]').dataset.bytes < n"""
ENDED = re.compile("^(cancelled|done)$")  # cancelled, unless it reached max_tokens first
LONG = 1500  # max_tokens of generations the tests stop themselves (tens of seconds of SmolLM2 decoding)


class ChatStream:
    """A streamed chat completion read in a thread until `stop()` (which closes the stream: the
    server cancels the generation)."""

    def __init__(self, server, who: str, max_tokens: int = LONG):
        self.client = server.client(who)
        self.body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens,
            "stream": True,
            # sampled, so without a seed and with end-of-text allowed a story may end in a few tokens,
            # before the tests see what they wait for: <|endoftext|> and <|im_end|> are banned
            "seed": 7,
            "logit_bias": {"0": -100, "2": -100},
        }
        self.stopping = threading.Event()
        self.chunks = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.client.stream("POST", "/v1/chat/completions", json=self.body) as r:
            for _ in r.iter_lines():
                self.chunks += 1
                if self.stopping.is_set():
                    return

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)
        self.client.close()


def lane(page, name: str):
    return page.locator(f'.lane[data-coroutine="{name}"]')


def lane_text(page, name: str) -> str:
    return lane(page, name).locator('[data-role="text"]').text_content() or ""


def gauge(page, name: str) -> int:
    node = page.locator(f'[data-gauge="{name}"]')
    text = node.text_content() or ""
    assert text.endswith(("B", "KiB", "MiB", "GiB")), text
    return int(node.get_attribute("data-bytes") or -1)


def start_session(server, who: str, max_tokens: int = LONG):
    """A session with blocks ctx (a sentence) and out, and a background generation over [ctx, out]."""
    http = server.client(who)
    sid = http.post("/v1/sessions", json={"name": f"{who}-session"}).json()["id"]
    base = f"/v1/sessions/{sid}"
    ctx = http.post(f"{base}/blocks", json={"name": "ctx", "text": "The quick brown fox"}).json()["id"]
    out = http.post(f"{base}/blocks", json={"name": "out"}).json()["id"]
    body = {"view": [ctx, out], "max_tokens": max_tokens, "stop_at_eos": False, "background": True}
    gen = http.post(f"{base}/generate", json=body).json()["id"]
    return http, base, ctx, out, gen


def test_a_chat_completion_streams_into_its_lane(server, pages, open_console):
    page = pages.new()
    open_console(page, server.url, server.key("alice"))
    timeline = page.locator("[data-timeline]")
    steps_before = timeline.locator("[data-step]").count()
    chat = ChatStream(server, "alice")
    try:
        chat_lane = page.locator('.lane[data-coroutine^="chatcmpl-"][data-kind="generate"]')
        expect(chat_lane).to_have_count(1, timeout=30_000)
        name = chat_lane.get_attribute("data-coroutine")
        expect(chat_lane).to_have_attribute("data-state", "running")
        expect(chat_lane).to_have_attribute("data-priority", "interactive")
        page.wait_for_function(
            "n => (document.querySelector(`.lane[data-coroutine='${n}'] [data-role=text]`).textContent"
            " || '').length > 0",
            arg=name,
        )
        first = len(lane_text(page, name))
        # the text grows while the generation runs
        page.wait_for_function(
            "([n, k]) => { const l = document.querySelector(`.lane[data-coroutine='${n}']`);"
            " const text = l.querySelector('[data-role=text]').textContent;"
            " return l.dataset.state === 'running' && text.length > k + 20; }",
            arg=[name, first],
        )
        # one mark per forward pass while it runs
        page.wait_for_function(
            "n => document.querySelectorAll('[data-timeline] [data-step]').length > n", arg=steps_before + 20
        )
    finally:
        chat.stop()
    expect(chat_lane).to_have_attribute("data-state", ENDED, timeout=30_000)
    # the timeline gained one mark per forward pass; hovering a step names its coroutines
    assert timeline.locator("[data-step]").count() > steps_before + 20
    last = timeline.locator("[data-step]").last
    last.hover()
    expect(page.locator("#step-detail")).to_contain_text("step ")
    assert name in (timeline.locator("[data-step]").nth(-3).get_attribute("title") or "")


def test_generation_probe_input_and_gauges(server, pages, open_console):
    page = pages.new()
    open_console(page, server.url, server.key("alice"))
    http, base, ctx, out, gen = start_session(server, "alice")
    expect(lane(page, gen)).to_have_attribute("data-state", "running", timeout=30_000)
    expect(lane(page, gen).locator(".blocks")).to_contain_text("reads ctx")
    # the session shows with its blocks
    session = page.locator(f'#sessions [data-session="{base.split("/")[-1]}"]')
    expect(session.locator(f'[data-block="{ctx}"]')).to_contain_text("ctx")

    # input appended to ctx mid-generation: marked on the generation's lane, which reads ctx
    kv_before = gauge(page, "kv")
    r = http.post(f"{base}/blocks/{ctx}/extend", json={"text": " jumps over the lazy dog. " * 12})
    assert r.status_code == 200, r.text
    expect(lane(page, gen).locator(f'mark[data-input="{ctx}"]')).to_have_count(1)
    page.wait_for_function(KV_ABOVE, arg=kv_before)

    # a probe of the same view: its own lane beside the generation, with the answer's probability
    probe = http.post(f"{base}/probe", json={"view": [ctx, out], "question": " Is it a fox?"}).json()
    mark = lane(page, probe["coroutine"]).locator("mark[data-probe]")
    expect(mark).to_have_count(1)
    expected = probe["probabilities"][probe["answer"]]
    assert float(mark.get_attribute("data-probe")) == pytest.approx(expected, abs=1e-5)
    expect(mark).to_contain_text(f"{expected:.2f}")
    a, b = lane(page, gen).bounding_box(), lane(page, probe["coroutine"]).bounding_box()
    assert a and b and (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"] or a["y"] != b["y"])
    expect(lane(page, gen)).to_be_in_viewport()
    expect(lane(page, probe["coroutine"])).to_be_in_viewport()

    # a release: the session goes, its blocks' memory returns
    http.post(f"{base}/coroutines/{gen}/cancel")
    expect(lane(page, gen)).to_have_attribute("data-state", ENDED)
    kv_held = gauge(page, "kv")
    assert http.delete(base).status_code in (200, 204)
    page.wait_for_function(KV_BELOW, arg=kv_held)
    expect(session).to_have_count(0)
    assert gauge(page, "budget") > 0 and gauge(page, "linear") == 0 and gauge(page, "spilled") == 0


def test_a_key_sees_only_its_own_coroutines(server, pages, open_console):
    alice, bob, root = pages.new(), pages.new(), pages.new()
    for page, who in ((alice, "alice"), (bob, "bob"), (root, "root")):
        open_console(page, server.url, server.key(who))
    http, base, ctx, out, gen = start_session(server, "alice")
    theirs = ChatStream(server, "bob", max_tokens=8)
    theirs.thread.join(60)
    expect(lane(alice, gen)).to_have_attribute("data-state", "running", timeout=30_000)
    expect(lane(root, gen)).to_be_visible()  # the admin sees everyone's
    bob_chat = bob.locator('.lane[data-coroutine^="chatcmpl-"][data-kind="generate"]')
    expect(bob_chat).to_have_count(1)
    expect(root.locator(f'.lane[data-coroutine="{bob_chat.get_attribute("data-coroutine")}"]')).to_have_count(
        1
    )
    http.post(f"{base}/coroutines/{gen}/cancel")
    expect(lane(alice, gen)).to_have_attribute("data-state", ENDED)
    # bob's page has seen the steps alice's generation ran in (as "others") but none of her lanes
    steps = alice.locator("[data-step]").count()
    bob.wait_for_function(f"() => document.querySelectorAll('[data-step]').length >= {min(steps, 600)}")
    names = bob.eval_on_selector_all(".lane", "ls => ls.map(l => l.dataset.coroutine)")
    assert names and all(n.startswith("chatcmpl-") for n in names), names
    assert gen not in bob.content() and ctx not in bob.content()
    assert alice.locator(f'.lane[data-coroutine="{bob_chat.get_attribute("data-coroutine")}"]').count() == 0
    http.delete(base)
    theirs.stop()


@pytest.mark.slow  # a second server start
def test_the_page_reconnects_after_a_server_restart(server, pages, open_console):
    page = pages.new()
    open_console(page, server.url, server.key("alice"))
    expect(page.locator("#connection")).to_have_attribute("data-connection", "live")
    assert server.stop() == 0
    expect(page.locator("#connection")).to_have_attribute("data-connection", "reconnecting", timeout=30_000)
    server.start()
    expect(page.locator("#connection")).to_have_attribute("data-connection", "live", timeout=60_000)
    chat = ChatStream(server, "alice", max_tokens=6)
    chat.thread.join(60)
    lanes = page.locator('.lane[data-coroutine^="chatcmpl-"][data-kind="generate"][data-state="done"]')
    expect(lanes).not_to_have_count(0)
    chat.stop()
