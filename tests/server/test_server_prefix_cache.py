"""Prefix reuse across OpenAI requests: a shared prompt prefix is forked from the cache, not prefilled."""

from __future__ import annotations

import httpx
from support import running_server, tiny_engine

from cothink.server import ServerSettings

KEY_A, KEY_B = "key-a-prefix-0001", "key-b-prefix-0002"
SYSTEM = "You are a careful assistant. " * 20


def chat(srv, key: str, question: str) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 6,
        "temperature": 0,
    }
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_shared_prefixes_are_reused_per_key_and_give_the_same_output():
    engine = tiny_engine(max_prefill_chunk=64)
    settings = ServerSettings(model_name="tiny", api_keys=(KEY_A, KEY_B))
    with running_server(engine, settings) as srv:
        first = chat(srv, KEY_A, "What is 2 + 2?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = chat(srv, KEY_A, "What is 2 + 2?")
        prompt = first["usage"]["prompt_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
        assert again["choices"][0]["message"] == first["choices"][0]["message"]  # same state, same text
        other = chat(srv, KEY_A, "And 3 + 3?")  # shares the system prompt
        assert 100 < other["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt
        # another key never reuses (nor learns about) key A's prompts
        assert chat(srv, KEY_B, "What is 2 + 2?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
        hits = [line for line in metrics.splitlines() if line.startswith("cothink_prefix_cache_hit_tokens")]
        assert hits and float(hits[0].split()[-1]) >= prompt - 1 + 100
        # under memory pressure the cache gives its pages back
        state = srv.app.state.cothink
        total = state.ledger.geometry.total_pages
        assert srv.call(lambda: len(state.prefix_cache.entries)) >= 2
        srv.call(state.prefix_cache.make_room, total)
        assert srv.call(lambda: (len(state.prefix_cache.entries), engine.memory().used_pages)) == (0, 0)
