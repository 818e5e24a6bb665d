"""Session snapshots over HTTP (POST .../snapshot, POST /v1/sessions/restore) and the memory gauges of
/metrics, on real loopback servers: a snapshot restored into a fresh engine reads like the saved
session (equal probe probabilities and greedy continuation, fp32); another model refuses it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from support import make_engine, running_server, tiny_engine

from cothink.client import Client, ClientError
from cothink.observability.metrics import count_dropped_events, parse_exposition
from cothink.server import ServerSettings

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"


def settings(snapshot_dir: Path, **kw) -> ServerSettings:
    return ServerSettings(
        model_name="tiny", api_keys=(KEY_A, KEY_B), snapshot_dir=str(snapshot_dir), **kw
    )


def continuation(s, view, n: int = 6) -> tuple[dict[str, float], list[int]]:
    """What a view reads as: probe probabilities (one forward pass: next-token logits) and a greedy
    continuation into a fork of the view's last block (the view itself is left as it is)."""
    probs = s.probe(view, " Answer yes or no:", choices=[" yes", " no", " maybe"])
    out = s.fork(view[-1])
    res = s.generate([*view[:-1], out], max_tokens=n)
    s.delete_block(out)
    return probs, res["token_ids"]


def test_snapshot_restores_into_a_fresh_engine_with_equal_logits(tmp_path):
    with running_server(tiny_engine(), settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        s = c.session("saved")
        ctx = s.block("You watch a stream of log lines.", name="context")
        notes = s.block(name="notes")
        s.extend(notes, " Line 1: disk at 91%. Line 2: disk at 97%.", view=[ctx, notes])
        s.generate([ctx, notes], max_tokens=5)  # generated tokens are saved too
        saved_blocks = {b.id: b for b in s.blocks(token_ids=True)}
        before = continuation(s, [ctx, notes])
        snap = s.snapshot()
        assert snap["id"].startswith("snap_") and snap["object"] == "session.snapshot"
        assert snap["session"] == s.id and snap["model"] == "tiny" and snap["bytes"] > 0
        assert [b["id"] for b in snap["blocks"]] == [ctx.id, notes.id]
        assert snap["tokens"] == sum(b.length for b in saved_blocks.values())
        # the snapshot lives under the server's directory, in a folder of the key, named by its id
        (folder,) = [p for p in tmp_path.glob(f"*/{snap['id']}")]
        assert sorted(p.name for p in folder.iterdir()) == ["blocks.safetensors", "session.json"]
        # a subset, in the order asked
        part = s.snapshot([notes])
        assert [b["id"] for b in part["blocks"]] == [notes.id]

    # a new server with a new engine (empty memory), the same snapshot directory
    with running_server(tiny_engine(), settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        r = c.restore(snap["id"])
        assert r.info["name"] == "saved" and r.info["snapshot"] == snap["id"]
        restored = {b.id: b for b in r.blocks(token_ids=True)}
        assert [b.id for b in r.restored_blocks] == [ctx.id, notes.id]
        assert [b.name for b in r.restored_blocks] == ["context", "notes"]
        for block_id, blk in saved_blocks.items():
            assert restored[block_id].token_ids == blk.token_ids
            assert restored[block_id].text == blk.text
        after = continuation(r, [ctx.id, notes.id])
        assert after[0] == before[0]  # probe probabilities bit-equal (fp32): the same KV
        assert after[1] == before[1]  # the same greedy continuation
        # the restored session is an ordinary one: it can be extended and restored again
        r.extend(notes.id, " Line 3: disk full.", view=[ctx.id, notes.id])
        again = c.restore(snap["id"], name="second")
        assert again.id != r.id and again.info["name"] == "second"
        assert again.get_block(notes.id).length == saved_blocks[notes.id].length
        assert r.info["usage"]["tokens"] == snap["tokens"]  # charged to the session quota

        # another key cannot see it; a deleted snapshot is gone
        with Client(srv.url, api_key=KEY_B) as other:
            with pytest.raises(ClientError) as err:
                other.restore(snap["id"])
            assert err.value.status == 404 and err.value.code == "snapshot_not_found"
        c.delete_snapshot(snap["id"])
        with pytest.raises(ClientError) as err:
            c.restore(snap["id"])
        assert err.value.status == 404 and err.value.code == "snapshot_not_found"


def test_restore_refuses_another_model_damage_and_paths(tmp_path):
    with running_server(tiny_engine(), settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        s = c.session()
        s.block("Some memory to keep.")
        snap = s.snapshot()["id"]
        broken = s.snapshot()["id"]
    (blocks_file,) = tmp_path.glob(f"*/{broken}/blocks.safetensors")
    blocks_file.write_bytes(b"\x00garbage, not safetensors")

    # another model (a different family, config and weights): 409 snapshot_mismatch, nothing created
    with running_server(make_engine("llama"), settings(tmp_path)) as srv:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
            r = http.post("/v1/sessions/restore", json={"snapshot": snap})
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "snapshot_mismatch" and err["type"] == "conflict_error"
            assert "different model" in err["message"] and str(tmp_path) not in err["message"]
            assert http.get("/v1/sessions").json() == []  # the half-made session is gone

    with running_server(tiny_engine(), settings(tmp_path)) as srv:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
            no_key = httpx.post(srv.url + "/v1/sessions/restore", json={"snapshot": snap}, timeout=30)
            assert no_key.status_code == 401
            r = http.post("/v1/sessions/restore", json={"snapshot": broken})
            assert r.status_code == 400 and r.json()["error"]["code"] == "snapshot_invalid", r.text
            assert str(tmp_path) not in r.json()["error"]["message"]
            # a client never names a path: traversal, absolute paths and separators are not ids
            outside = tmp_path.parent / "outside.safetensors"
            for bad in ("../" + snap, f"{snap}/../{snap}", str(blocks_file), "snap_../../../etc/passwd",
                        "..", "snap_" + "a" * 10 + "/x" * 5, str(outside)):
                r = http.post("/v1/sessions/restore", json={"snapshot": bad})
                assert r.status_code in (400, 422) and r.json()["error"]["code"] in (
                    "invalid_snapshot_id", "invalid_request"), (bad, r.text)
                r = http.delete(f"/v1/sessions/snapshots/{quote(bad, safe='')}")
                assert r.status_code in (400, 404, 405), (bad, r.text)
            assert not outside.exists()
            r = http.post("/v1/sessions/restore", json={"snapshot": "snap_" + "A" * 24})
            assert r.status_code == 404 and r.json()["error"]["code"] == "snapshot_not_found"
            assert http.get("/v1/sessions").json() == []
            # the good snapshot still restores on the right model
            r = http.post("/v1/sessions/restore", json={"snapshot": snap})
            assert r.status_code == 201, r.text


def test_snapshot_quota_and_restore_quotas(tmp_path):
    conf = settings(tmp_path, key_max_snapshots=2, session_max_tokens=60)
    with running_server(tiny_engine(), conf) as srv, Client(srv.url, api_key=KEY_A) as c:
        s = c.session()
        with pytest.raises(ClientError) as err:
            s.snapshot()  # nothing to save
        assert err.value.status == 400
        s.block(token_ids=list(range(100, 140)))
        first = s.snapshot()["id"]
        s.snapshot()
        with pytest.raises(ClientError) as err:
            s.snapshot()
        assert err.value.status == 429 and err.value.code == "snapshot_quota"
        c.restore(first)  # 40 tokens: within the new session's 60
        s.extend(s.blocks()[0], token_ids=list(range(10)))
        c.delete_snapshot(first)
        big = s.snapshot()["id"]  # 50 tokens in the saved session
        r = c.restore(big)
        assert r.info["usage"]["tokens"] == 50
    # a server with a smaller session quota refuses it, and keeps no half-restored session
    conf = settings(tmp_path, key_max_snapshots=2, session_max_tokens=45)
    with running_server(tiny_engine(), conf) as srv, Client(srv.url, api_key=KEY_A) as c:
        with pytest.raises(ClientError) as err:
            c.restore(big)
        assert err.value.status == 429 and err.value.code == "session_token_quota"
        assert c.request("GET", "/v1/sessions") == []


def test_metrics_export_memory_gauges_that_follow_extends(tmp_path):
    engine = make_engine("qwen35", memory_budget="64MiB")  # hybrid: KV pages and Gated DeltaNet records
    with running_server(engine, settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        auth = {"Authorization": f"Bearer {KEY_A}"}

        def scrape() -> dict:
            return parse_exposition(httpx.get(srv.url + "/metrics", headers=auth, timeout=30).text)

        m0 = scrape()
        for name in ("cothink_kv_bytes_used", "cothink_linear_bytes_used", "cothink_total_bytes_used",
                     "cothink_spilled_bytes", "cothink_sealed_blocks", "cothink_spilled_blocks",
                     "cothink_kv_bytes_per_token", "cothink_linear_bytes_per_token"):
            assert name in m0, name
        assert m0["cothink_memory_budget_bytes"] == 64 * 2**20
        s = c.session()
        blk = s.block(token_ids=list(range(40, 90)))
        m1 = scrape()
        assert m1["cothink_kv_bytes_used"] > m0["cothink_kv_bytes_used"]
        assert m1["cothink_linear_bytes_used"] > m0["cothink_linear_bytes_used"]
        assert m1["cothink_total_bytes_used"] == m1["cothink_kv_bytes_used"] + m1["cothink_linear_bytes_used"]
        s.extend(blk, token_ids=list(range(90, 190)))
        m2 = scrape()
        assert m2["cothink_linear_bytes_used"] - m1["cothink_linear_bytes_used"] == (
            100 * m2["cothink_linear_bytes_per_token"])
        assert m2["cothink_total_bytes_used"] > m1["cothink_total_bytes_used"]
        s.delete()
        assert scrape()["cothink_total_bytes_used"] < m2["cothink_total_bytes_used"]
        # agents in this process count what their bounded queues dropped; /metrics exports it
        count_dropped_events("metrics-test-agent", 3)
        assert scrape()['cothink_stream_events_dropped_total{agent="metrics-test-agent"}'] == 3
