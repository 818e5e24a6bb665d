"""Memory accounting as an attacker probes it: pages a key releases while a generation still reads them
stay counted until they are free; the keys' shares (admin keys included) never add up to more than
the pool, so a request within its key's share is admitted, not left to wait for memory another key
holds; pages the prefix cache keeps for no key give way to what the keys were promised.

The model is the tiny random-weight Llama with SmolLM2's tokenizer (tests/support.py), on real
loopback servers or on a real engine with the server's session manager.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
from support import ids, make_engine, running_server, tiny_engine, until

from cothink.errors import InvalidParameterError
from cothink.server import ServerSettings
from cothink.server.quota import MemoryLedger
from cothink.server.sessions import SessionManager
from cothink.server.state import pool_geometry

KEY_A, KEY_B, ADMIN = "key-a-0123456789", "key-b-9876543210", "key-admin-5555555"
PAGE = 16


async def test_a_released_block_counts_until_no_generation_reads_it():
    engine = make_engine("llama", kv_tokens=4096, page_size=PAGE)
    settings = ServerSettings(model_name="tiny", api_keys=(KEY_A,))
    async with engine:
        ledger = MemoryLedger(pool_geometry(engine), None, None)
        session = SessionManager(engine, settings, ledger).create(KEY_A)
        ctx = session.new_block(None)
        await engine.extend(ctx.block, token_ids=ids(10 * PAGE, 1))  # 10 pages
        out = session.new_block(None)
        reader = engine.generate([ctx.block, out.block], max_tokens=64)
        reader.pause()  # before its first step: it holds the blocks it reads, and keeps holding them
        counted, in_pool = ledger.usage(account=session.account).pages, engine.memory().used_pages

        session.delete_block(ctx.id)
        assert not ctx.block.freed and engine.memory().used_pages == in_pool  # still read
        assert ledger.usage(account=session.account).pages == counted  # so still counted
        assert ledger.usage(session=session.id).pages == counted

        reader.cancel()
        await until(lambda: ctx.block.freed)
        assert engine.memory().used_pages == in_pool - 10
        assert ledger.usage(account=session.account).pages == counted - 10  # free now: no longer counted


def test_the_keys_shares_never_promise_more_than_the_pool():
    three = dict(api_keys=(KEY_A, KEY_B), admin_keys=(ADMIN,))
    assert ServerSettings(**three).memory_share() * 3 <= 1
    assert ServerSettings(api_keys=(KEY_A,)).memory_share() == 1
    with pytest.raises(InvalidParameterError) as err:
        ServerSettings(key_memory_share=0.5, **three)
    assert err.value.param == "key_memory_share" and "1.5" in str(err.value)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(InvalidParameterError):
            ServerSettings(key_memory_share=bad)
    settings = ServerSettings(**three)
    settings.key_memory_share = 0.9  # changed after construction: the server checks again when it starts
    with pytest.raises(InvalidParameterError):
        settings.check()

    from cothink.server import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = ["serve", "--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN]
    with pytest.raises(InvalidParameterError):
        cli.settings_from_args(parser.parse_args([*args, "--key-memory-share", "0.5"]))
    assert cli.settings_from_args(parser.parse_args(args)).memory_share() == pytest.approx(1 / 3)


def test_a_request_within_its_keys_share_is_admitted_while_the_other_keys_hold_theirs():
    # 30 pages; a request that had to wait for memory would fail after 2 s with 503 pool_exhausted
    engine = tiny_engine(kv_tokens=30 * PAGE, page_size=PAGE, pool_wait_s=2)
    settings = ServerSettings(model_name="tiny", api_keys=(KEY_A, KEY_B), admin_keys=(ADMIN,))
    with running_server(engine, settings) as srv:
        clients = {
            key: httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
            for key in (KEY_A, ADMIN, KEY_B)
        }
        try:
            total = clients[KEY_A].get("/health").json()["memory"]["total_pages"]
            sessions = {key: http.post("/v1/sessions").json() for key, http in clients.items()}
            share = sessions[KEY_A]["limits"]["key_max_pages"]
            assert all(s["limits"]["key_max_pages"] == share for s in sessions.values())
            assert 3 * share <= total  # no key is promised pages another key may hold
            for n, key in enumerate((KEY_A, ADMIN, KEY_B)):  # each key fills its whole share
                r = clients[key].post(
                    f"/v1/sessions/{sessions[key]['id']}/blocks", json={"token_ids": ids(share * PAGE, n)}
                )
                assert r.status_code == 201, (key, r.text)
                assert r.json()["length"] == share * PAGE
            # one more page is over the key's share: refused at once, never left to wait
            r = clients[KEY_A].post(f"/v1/sessions/{sessions[KEY_A]['id']}/blocks", json={"token_ids": [5]})
            assert r.status_code == 429 and r.json()["error"]["code"] == "key_memory_quota", r.text
            memory = clients[KEY_A].get("/health").json()["memory"]
            assert memory["used_pages"] == memory["reserved_pages"] == 3 * share
        finally:
            for http in clients.values():
                http.close()


def test_prefix_cache_pages_give_way_to_a_request_within_its_share():
    engine = tiny_engine(kv_tokens=30 * PAGE, page_size=PAGE, pool_wait_s=2)
    settings = ServerSettings(model_name="tiny", api_keys=(KEY_A,), prefix_cache_share=0.25)
    with running_server(engine, settings) as srv, httpx.Client(
        base_url=srv.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60
    ) as http:
        prompt = {"model": "tiny", "prompt": ids(6 * PAGE, 7), "max_tokens": 1}
        assert http.post("/v1/completions", json=prompt).status_code == 200
        cached = srv.call(lambda: srv.app.state.cothink.prefix_cache.pages())
        assert cached == 6  # pages held for no key: the request is over, the cache keeps its prompt
        sid = http.post("/v1/sessions").json()["id"]
        total = http.get("/health").json()["memory"]["total_pages"]
        r = http.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": ids((total - 1) * PAGE, 8)})
        assert r.status_code == 201, r.text  # the cache gave its pages back instead of the request waiting
        assert srv.call(lambda: srv.app.state.cothink.prefix_cache.pages()) <= 1
