"""Snapshot limits as an attacker probes them, on real loopback servers: forks are stored once (bytes on
disk bounded by the distinct pages), each key's snapshot bytes are bounded, old snapshots expire, a key
lists its snapshots and deletes unfinished ones, damaged data is refused with a typed error, and a
restore is checked against the key's quotas before its data is read."""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import httpx
import pytest
from support import ids, running_server, tiny_engine

from cothink.client import Client, ClientError
from cothink.server import ServerSettings

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
PAGE = 16


def settings(snapshot_dir: Path, **kw) -> ServerSettings:
    return ServerSettings(model_name="tiny", api_keys=(KEY_A, KEY_B), snapshot_dir=str(snapshot_dir), **kw)


def tensor_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensor data (the file minus its length prefix and JSON header)."""
    with path.open("rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def flip(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def http_for(srv, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_forks_are_stored_once_and_restore_exactly(tmp_path):
    engine = tiny_engine(kv_tokens=4096, page_size=PAGE)
    with running_server(engine, settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        per_page = c.request("GET", "/health")["memory"]["bytes_per_page"]
        s = c.session()
        base = s.block(token_ids=ids(16 * PAGE, 1))  # 16 pages
        forks = [s.fork(base) for _ in range(12)]
        s.extend(forks[0], token_ids=ids(PAGE, 2))  # one fork grows by one page of its own
        snap = s.snapshot()
        (blocks_file,) = tmp_path.glob(f"*/{snap['id']}/blocks.safetensors")
        # 17 distinct pages, whatever the number of forks reading them (13 blocks x 16 pages in full)
        assert tensor_bytes(blocks_file) <= 17 * per_page
        assert snap["bytes"] >= tensor_bytes(blocks_file)
        before = s.probe([forks[0]], " Yes or no?", choices=[" yes", " no"])
        r = c.restore(snap["id"])
        assert [b.id for b in r.restored_blocks] == [base.id, *(f.id for f in forks)]
        assert r.get_block(forks[0].id).length == 17 * PAGE and r.get_block(forks[5].id).length == 16 * PAGE
        assert r.probe([forks[0].id], " Yes or no?", choices=[" yes", " no"]) == before


def test_damaged_data_is_refused_with_a_typed_error(tmp_path):
    with running_server(tiny_engine(), settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        s = c.session()
        s.block(token_ids=ids(5 * PAGE, 3))
        data_snap, header_snap = s.snapshot()["id"], s.snapshot()["id"]
        (data_file,) = tmp_path.glob(f"*/{data_snap}/blocks.safetensors")
        (header_file,) = tmp_path.glob(f"*/{header_snap}/blocks.safetensors")
        flip(data_file, data_file.stat().st_size - 300, 200)  # 200 bytes inside the KV data
        data = bytearray(header_file.read_bytes())
        at = data.index(b'tokens\\": [') + len(b'tokens\\": [')  # the header's JSON, in safetensors' own
        data[at] = ord("7") if data[at] != ord("7") else ord("8")  # one token id: still valid JSON
        header_file.write_bytes(bytes(data))
        with http_for(srv, KEY_A) as http:
            for snap in (data_snap, header_snap):
                r = http.post("/v1/sessions/restore", json={"snapshot": snap})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "snapshot_invalid" and "damaged" in err["message"]
                assert str(tmp_path) not in err["message"]
            assert [x["id"] for x in http.get("/v1/sessions").json()] == [s.id]  # no half-made session


def test_snapshot_bytes_per_key_are_bounded(tmp_path):
    engine = tiny_engine(kv_tokens=4096, page_size=PAGE)
    with running_server(engine, settings(tmp_path, key_max_snapshot_bytes=200_000)) as srv:
        with Client(srv.url, api_key=KEY_A) as c:
            s = c.session()
            s.block(token_ids=ids(8 * PAGE, 4))  # 8 pages of 8 KiB: about 70 KB a snapshot
            first = s.snapshot()
            second = s.snapshot()
            assert first["bytes"] + second["bytes"] <= 200_000
            with pytest.raises(ClientError) as err:
                s.snapshot()  # would take the key past its bytes: deleted and refused
            assert err.value.status == 429 and err.value.code == "snapshot_bytes_quota"
            listed = c.snapshots()
            assert sorted(x["id"] for x in listed) == sorted([first["id"], second["id"]])
            assert sum(x["bytes"] for x in listed) <= 200_000
            c.delete_snapshot(first["id"])
            assert s.snapshot()["bytes"] > 0  # room again
        with Client(srv.url, api_key=KEY_B) as other:  # another key has its own bytes
            t = other.session()
            t.block(token_ids=ids(8 * PAGE, 5))
            assert t.snapshot()["bytes"] > 0


def test_list_expire_and_delete_unfinished_snapshots(tmp_path):
    conf = settings(tmp_path, key_max_snapshots=3, snapshot_ttl_s=3600.0)
    with running_server(tiny_engine(), conf) as srv, Client(srv.url, api_key=KEY_A) as c:
        s = c.session()
        s.block(token_ids=ids(3 * PAGE, 6), name="notes")
        kept, old, cut = (s.snapshot()["id"] for _ in range(3))
        with http_for(srv, KEY_A) as http:
            # the route is not taken for a session id
            listed = http.get("/v1/sessions/snapshots")
            assert listed.status_code == 200, listed.text
            assert {x["id"] for x in listed.json()} == {kept, old, cut}
            entry = next(x for x in listed.json() if x["id"] == kept)
            assert entry["status"] == "complete" and entry["bytes"] > 0 and entry["tokens"] == 3 * PAGE
            assert entry["blocks"][0]["name"] == "notes" and entry["session"] == s.id
            with http_for(srv, KEY_B) as other:
                assert other.get("/v1/sessions/snapshots").json() == []  # each key sees its own

            # saved long ago: expired (deleted) the next time the key lists, saves or restores
            (manifest,) = tmp_path.glob(f"*/{old}/session.json")
            record = json.loads(manifest.read_text())
            record["created"] = int(time.time()) - 7200
            manifest.write_text(json.dumps(record))
            # a save a crash cut short: its data without its session record
            (cut_manifest,) = tmp_path.glob(f"*/{cut}/session.json")
            cut_manifest.unlink()

            listed = {x["id"]: x for x in http.get("/v1/sessions/snapshots").json()}
            assert set(listed) == {kept, cut} and listed[cut]["status"] == "unfinished"
            assert listed[cut]["bytes"] > 0 and listed[cut]["blocks"] is None
            r = http.post("/v1/sessions/restore", json={"snapshot": old})
            assert r.status_code == 404 and r.json()["error"]["code"] == "snapshot_not_found"
            r = http.post("/v1/sessions/restore", json={"snapshot": cut})
            assert r.status_code == 404  # unfinished: nothing to restore
            # the unfinished one holds a slot until its owner deletes it; another key cannot
            assert http.post(f"/v1/sessions/{s.id}/snapshot").status_code == 201  # 3 of 3 slots
            r = http.post(f"/v1/sessions/{s.id}/snapshot")
            assert r.status_code == 429 and r.json()["error"]["code"] == "snapshot_quota"
            with http_for(srv, KEY_B) as other:
                assert other.delete(f"/v1/sessions/snapshots/{cut}").status_code == 404
            r = http.delete(f"/v1/sessions/snapshots/{cut}")
            assert r.status_code == 200, r.text
            assert cut not in {x["id"] for x in http.get("/v1/sessions/snapshots").json()}
            assert http.post(f"/v1/sessions/{s.id}/snapshot").status_code == 201
            assert http.delete(f"/v1/sessions/snapshots/{cut}").status_code == 404


def test_restore_checks_the_keys_memory_before_reading_the_data(tmp_path):
    engine = tiny_engine(kv_tokens=40 * PAGE, page_size=PAGE)  # 40 pages; two keys: 20 each
    with running_server(engine, settings(tmp_path)) as srv, Client(srv.url, api_key=KEY_A) as c:
        s = c.session()
        blk = s.block(token_ids=ids(12 * PAGE, 7))
        snap = s.snapshot()["id"]
        (data_file,) = tmp_path.glob(f"*/{snap}/blocks.safetensors")
        flip(data_file, data_file.stat().st_size - 300, 200)
        # 12 pages held + 12 more > 20: refused from the snapshot's header, before its (damaged) data
        with pytest.raises(ClientError) as err:
            c.restore(snap)
        assert err.value.status == 429 and err.value.code == "key_memory_quota"
        s.delete_block(blk)
        with pytest.raises(ClientError) as err:
            c.restore(snap)  # room now: the data is read, and its damage found
        assert err.value.status == 400 and err.value.code == "snapshot_invalid"
        assert [x["id"] for x in c.request("GET", "/v1/sessions")] == [s.id]  # no half-made session


def test_serve_flags_for_snapshot_limits():
    from cothink.server import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--key-max-snapshot-bytes", "512MiB", "--snapshot-ttl-s", "0"])
    conf = cli.settings_from_args(args)
    assert conf.key_max_snapshot_bytes == 512 * 2**20 and conf.snapshot_ttl_s is None
    defaults = cli.settings_from_args(parser.parse_args(["serve"]))
    assert defaults.key_max_snapshot_bytes == ServerSettings().key_max_snapshot_bytes
    assert defaults.snapshot_ttl_s == ServerSettings().snapshot_ttl_s
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--key-max-snapshot-bytes", "lots"])


def test_a_save_that_would_pass_the_keys_bytes_is_deleted_when_written(tmp_path):
    from cothink.server.errors import APIError
    from cothink.server.snapshots import SnapshotManifest, SnapshotStore

    store = SnapshotStore(tmp_path, max_per_owner=8, max_bytes_per_owner=1000)
    snap_id, folder = store.create("k", at_least=100)
    (folder / "blocks.safetensors").write_bytes(b"x" * 1500)  # larger than its lower bound said
    manifest = SnapshotManifest(snap_id, "sess_x", None, int(time.time()), "tiny", [])
    with pytest.raises(APIError) as err:
        store.commit("k", folder, manifest)
    assert err.value.status == 429 and err.value.code == "snapshot_bytes_quota"
    assert not folder.exists() and store.entries("k") == []
    with pytest.raises(APIError) as err:
        store.create("k", at_least=1001)  # refused before anything is written
    assert err.value.code == "snapshot_bytes_quota" and store.held("k") == (0, 0)


def test_without_keys_snapshots_are_not_listed(tmp_path):
    conf = ServerSettings(model_name="tiny", snapshot_dir=str(tmp_path))
    with running_server(tiny_engine(), conf) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["id"]
        http.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": ids(PAGE, 9)})
        assert http.post(f"/v1/sessions/{sid}/snapshot").status_code == 201
        r = http.get("/v1/sessions/snapshots")
        assert r.status_code == 403 and r.json()["error"]["code"] == "listing_disabled"
