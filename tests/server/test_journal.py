"""The session journal: its record framing (torn tails dropped, damage found and located) and what a
server restarted on a journal directory restores (ids, key scoping, forks, truncations, releases,
deletions, finished generations), with damaged files in the directory.

Crashes of real server processes are in test_crash_recovery.py.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import httpx
import pytest
from support import running_server, sse_events, tiny_engine, wait_for

from cothink.errors import InvalidParameterError
from cothink.server import ServerSettings, create_app
from cothink.server.journal import (
    MAGIC,
    SNAPSHOT_SUFFIX,
    SUFFIX,
    JournalCorruptError,
    JournalFile,
    encode,
    open_journal,
    scan,
)
from cothink.server.recovery import RecoveryProgress
from cothink.server.runner import BackgroundServer

RECORDS = [{"t": "session", "id": "sess_x"}, {"t": "block", "id": "blk_a"}, {"t": "tokens", "ids": [1, 2, 3]}]


def write_journal(path: Path, records: list[dict]) -> list[int]:
    """The records framed into `path`; returns each record's offset."""
    file = JournalFile.create(path)
    offsets = []
    for r in records:
        offsets.append(file.end)
        file.append(encode(r), sync=False)
    file.close()
    return offsets


def test_records_read_back_and_a_torn_last_record_is_dropped_wherever_it_was_cut(tmp_path: Path) -> None:
    path = tmp_path / f"s{SUFFIX}"
    offsets = write_journal(path, RECORDS)
    whole = path.read_bytes()
    assert whole.startswith(MAGIC)
    done = scan(path)
    assert done.records == RECORDS and done.end == len(whole) and done.torn_bytes == 0
    for cut in range(offsets[-1] + 1, len(whole)):
        path.write_bytes(whole[:cut])
        torn = scan(path)
        assert torn.records == RECORDS[:-1], cut
        assert torn.end == offsets[-1] and torn.torn_bytes == cut - offsets[-1]
    path.write_bytes(whole + bytes(300))  # a tail the file system filled with zeros
    assert scan(path).records == RECORDS and scan(path).torn_bytes == 300
    path.write_bytes(MAGIC[:3])  # cut while the file was created
    assert scan(path).records == []


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_damaged_record_before_the_last_names_the_file_and_its_offset(tmp_path: Path, where: str) -> None:
    path = tmp_path / f"s{SUFFIX}"
    offsets = write_journal(path, RECORDS)
    data = bytearray(path.read_bytes())
    data[offsets[1] + (14 if where == "payload" else 1)] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError) as caught:
        scan(path)
    assert caught.value.offset == offsets[1] and caught.value.path == path
    assert str(path) in str(caught.value) and f"byte {offsets[1]}" in str(caught.value)


def test_journal_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="journal_sync"):
        open_journal(ServerSettings(journal_dir=str(tmp_path), journal_sync="sometimes"))
    with pytest.raises(InvalidParameterError, match="journal_sync_interval_s"):
        open_journal(ServerSettings(journal_dir=str(tmp_path), journal_sync_interval_s=5))
    assert not open_journal(ServerSettings()).enabled


KEYS = ("key-alice", "key-bob")


def settings(directory: Path, sync: str = "interval") -> ServerSettings:
    return ServerSettings(
        model_name="tiny", api_keys=KEYS, journal_dir=str(directory), journal_sync=sync, session_idle_s=None
    )


def client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def ready(server) -> None:
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=120)


def blocks_of(http: httpx.Client, sid: str) -> dict[str, list[int]]:
    data = http.get(f"/v1/sessions/{sid}/blocks", params={"token_ids": "true"}).json()["data"]
    return {b["id"]: b["token_ids"] for b in data}


@pytest.mark.parametrize("sync", ["always", "never"])
def test_a_restarted_server_restores_sessions_with_their_ids_keys_and_history(
    tmp_path: Path, sync: str
) -> None:
    journal = tmp_path / "journal"
    with running_server(tiny_engine(), settings(journal, sync)) as server:
        ready(server)
        with client(server, KEYS[0]) as alice, client(server, KEYS[1]) as bob:
            sid = alice.post("/v1/sessions", json={"name": "kept"}).json()["id"]
            gone = bob.post("/v1/sessions").json()["id"]
            base = f"/v1/sessions/{sid}"
            a = alice.post(f"{base}/blocks", json={"token_ids": [11, 12, 13, 14, 15], "name": "a"}).json()[
                "id"
            ]
            b = alice.post(f"{base}/blocks").json()["id"]
            events = sse_events(
                alice.post(
                    f"{base}/generate",
                    json={
                        "view": [a, b],
                        "max_tokens": 6,
                        "temperature": 1.0,
                        "seed": 3,
                        "stop_at_eos": False,
                    },
                )
            )
            streamed = [t for e in events if e["type"] == "token" for t in e["token_ids"]]
            generation = events[0]["coroutine"]
            assert events[-1]["type"] == "end" and len(streamed) == 6
            assert alice.post(f"{base}/blocks/{a}/truncate", json={"length": 2}).status_code == 200
            fork = alice.post(f"{base}/blocks/{b}/fork").json()["id"]
            assert (
                alice.post(
                    f"{base}/blocks/{fork}/extend", json={"token_ids": [7, 8], "view": [a, fork]}
                ).status_code
                == 200
            )
            released = alice.post(f"{base}/blocks", json={"token_ids": [1]}).json()["id"]
            assert alice.delete(f"{base}/blocks/{released}").status_code == 200
            assert bob.delete(f"/v1/sessions/{gone}").status_code == 200
            before = blocks_of(alice, sid)
    assert before == {a: [11, 12], b: streamed, fork: streamed + [7, 8]}
    assert sorted(p.name for p in journal.iterdir()) == [f"{sid}{SUFFIX}"]  # the deleted session's is gone

    with running_server(tiny_engine(), settings(journal, sync)) as server:
        ready(server)
        with client(server, KEYS[0]) as alice, client(server, KEYS[1]) as bob:
            assert blocks_of(alice, sid) == before
            info = alice.get(f"/v1/sessions/{sid}").json()
            assert info["name"] == "kept" and info["usage"]["blocks"] == 3
            assert alice.get(f"/v1/sessions/{sid}/blocks/{a}").json()["name"] == "a"
            co = alice.get(f"/v1/sessions/{sid}/coroutines/{generation}").json()
            assert co["finish_reason"] == "length" and co["tokens"] == 6
            assert bob.get(f"/v1/sessions/{sid}").status_code == 404
            assert alice.get(f"/v1/sessions/{gone}").status_code == 404
            assert bob.get(f"/v1/sessions/{gone}").status_code == 404
            r = alice.post(
                f"/v1/sessions/{sid}/generate", json={"view": [a, b], "max_tokens": 3, "stream": False}
            )
            assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
            assert blocks_of(alice, sid)[b] == streamed + r.json()["token_ids"]


def test_a_torn_tail_is_dropped_and_a_damaged_middle_stops_only_its_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "journal"
    with running_server(tiny_engine(), settings(journal)) as server:
        ready(server)
        with client(server, KEYS[0]) as alice:
            sids = [alice.post("/v1/sessions").json()["id"] for _ in range(2)]
            for sid in sids:
                for ids in ([5, 6, 7], [8, 9]):
                    alice.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": ids})
            before = blocks_of(alice, sids[0])
    torn, damaged = (journal / f"{sid}{SUFFIX}" for sid in sids)
    with torn.open("ab") as f:  # a record whose write the crash cut short
        f.write(encode({"t": "tokens", "block": next(iter(before)), "co": None, "ids": [1, 2, 3]})[:-5])
    data = bytearray(damaged.read_bytes())
    middle = scan(damaged)
    offset = len(MAGIC) + len(encode(middle.records[0]))  # the second record
    data[offset + 20] ^= 0x01
    damaged.write_bytes(bytes(data))

    caplog.set_level(logging.WARNING, logger="cothink.server.journal")
    app = create_app(tiny_engine(), settings(journal))
    with BackgroundServer(app) as server:
        ready(server)
        report = server.call(lambda: app.state.cothink.recovery.report())
        assert (
            report["sessions_restored"] == 1 and report["sessions_failed"] == 1 and report["torn_tails"] == 1
        )
        assert str(damaged) in report["errors"][0] and f"byte {offset}" in report["errors"][0]
        assert any(str(damaged) in r.message and f"byte {offset}" in r.message for r in caplog.records)
        assert any("torn" in r.message and str(torn) in r.message for r in caplog.records)
        with client(server, KEYS[0]) as alice:
            assert blocks_of(alice, sids[0]) == before
            assert alice.get(f"/v1/sessions/{sids[1]}").status_code == 404
            block = next(iter(before))
            r = alice.post(f"/v1/sessions/{sids[0]}/blocks/{block}/extend", json={"token_ids": [4]})
            assert r.status_code == 200
    assert damaged.exists()  # kept for whoever repairs it
    assert scan(torn).torn_bytes == 0  # appends went on after the last whole record


def test_only_health_answers_while_sessions_are_restored(tmp_path: Path) -> None:
    app = create_app(tiny_engine(), settings(tmp_path / "journal"))
    with BackgroundServer(app) as server:
        ready(server)
        state = app.state.cothink
        progress = RecoveryProgress(sessions_total=3, sessions_restored=1)
        server.call(lambda: setattr(state, "recovery", progress))
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "recovering"
        assert health.json()["recovery"]["sessions_total"] == 3
        r = httpx.post(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "recovering"
        assert r.headers["retry-after"] == "1" and "1 of 3" in r.json()["error"]["message"]
        progress.running = False
        assert httpx.get(server.url + "/health").status_code == 200


def test_the_journal_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / f"s{SUFFIX}"
    write_journal(path, RECORDS)
    assert os.stat(path).st_mode & 0o077 == 0


def test_writes_the_journal_refuses_fail_with_507_change_nothing_and_resume_with_it(tmp_path: Path) -> None:
    """The session's journal file stops taking writes (its descriptor made read-only: every write(2)
    fails with EBADF) while a generation streams into it."""
    journal_dir = tmp_path / "journal"
    app = create_app(tiny_engine(), settings(journal_dir))
    with BackgroundServer(app) as server:
        ready(server)
        journal = app.state.cothink.journal
        with client(server, KEYS[0]) as alice:
            sid, other = (alice.post("/v1/sessions").json()["id"] for _ in range(2))
            base = f"/v1/sessions/{sid}"
            a = alice.post(f"{base}/blocks", json={"token_ids": [3, 4, 5]}).json()["id"]
            b = alice.post(f"{base}/blocks").json()["id"]
            file = journal.files[sid]
            readonly = os.open(file.path, os.O_RDONLY)
            writable = file.fd
            received, last = [], None
            body = {"view": [a, b], "max_tokens": 1500, "temperature": 1.0, "seed": 1, "stop_at_eos": False}
            with alice.stream("POST", f"{base}/generate", json=body) as r:
                for line in r.iter_lines():  # event by event, as they arrive
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"] == "token":
                        received += event["token_ids"]
                        if file.fd == writable:
                            server.call(lambda: setattr(file, "fd", readonly))
                    last = event
            assert last["type"] == "error" and last["error"]["code"] == "journal_unavailable", last
            assert last["error"]["type"] == "storage_error"
            held = alice.get(f"{base}/blocks/{b}", params={"token_ids": "true"}).json()["token_ids"]
            journaled = [
                t
                for rec in scan(file.path).records
                if rec["t"] == "tokens" and rec["block"] == b
                for t in rec["ids"]
            ]
            assert held == journaled and held[: len(received)] == received and len(held) < 1500
            r = alice.post(f"{base}/blocks/{a}/extend", json={"token_ids": [6]})
            assert r.status_code == 507 and r.json()["error"]["code"] == "journal_unavailable"
            assert alice.get(f"{base}/blocks/{a}", params={"token_ids": "true"}).json()["token_ids"] == [
                3,
                4,
                5,
            ]
            assert alice.post(f"/v1/sessions/{other}/blocks", json={"token_ids": [1]}).status_code == 201
            server.call(lambda: setattr(file, "fd", writable))
            os.close(readonly)
            assert alice.post(f"{base}/blocks/{a}/extend", json={"token_ids": [6]}).status_code == 200
            before = blocks_of(alice, sid)
    assert before == {a: [3, 4, 5, 6], b: held}
    with running_server(tiny_engine(), settings(journal_dir)) as server:
        ready(server)
        with client(server, KEYS[0]) as alice:
            assert blocks_of(alice, sid) == before


def _holds(ids: list[int], run: list[int]) -> bool:
    return any(ids[j : j + len(run)] == run for j in range(len(ids) - len(run) + 1))


def test_a_long_journal_is_compacted_onto_a_snapshot_and_restores_from_it(tmp_path: Path) -> None:
    journal_dir = tmp_path / "journal"
    compacting = ServerSettings(
        model_name="tiny",
        api_keys=KEYS,
        journal_dir=str(journal_dir),
        session_idle_s=None,
        journal_compact_bytes=2048,
        journal_sync_interval_s=0.05,
    )
    app = create_app(tiny_engine(), compacting)
    with BackgroundServer(app) as server:
        ready(server)
        with client(server, KEYS[0]) as alice:
            sid = alice.post("/v1/sessions", json={"name": "long"}).json()["id"]
            base = f"/v1/sessions/{sid}"
            a = alice.post(f"{base}/blocks", json={"token_ids": list(range(100, 140)), "name": "a"}).json()[
                "id"
            ]
            b = alice.post(f"{base}/blocks").json()["id"]
            path = journal_dir / f"{sid}{SUFFIX}"

            def compacted() -> bool:
                return scan(path).records[1]["t"] == "base"

            for i in range(40):
                assert (
                    alice.post(f"{base}/blocks/{a}/extend", json={"token_ids": [200 + i] * 8}).status_code
                    == 200
                )
                r = alice.post(
                    f"{base}/generate",
                    json={
                        "view": [a, b],
                        "max_tokens": 4,
                        "stream": False,
                        "temperature": 1.0,
                        "seed": i,
                        "stop_at_eos": False,
                    },
                )
                assert r.status_code == 200
                if i >= 10 and compacted():
                    break
            assert wait_for(compacted, timeout=30)

            def one_snapshot_named() -> bool:  # a compaction may be writing the next one meanwhile
                snapshots = list(journal_dir.glob(f"*{SNAPSHOT_SUFFIX}"))
                return len(snapshots) == 1 and scan(path).records[1]["snapshot"] == snapshots[0].name

            assert wait_for(one_snapshot_named, timeout=30)
            fork = alice.post(f"{base}/blocks/{b}/fork").json()["id"]  # after the snapshot: in the tail
            assert alice.post(f"{base}/blocks/{fork}/extend", json={"token_ids": [9]}).status_code == 200
            last = alice.post(
                f"{base}/generate", json={"view": [a, b], "max_tokens": 3, "stream": False}
            ).json()
            first = scan(path).records[1]["snapshot"]
            for i in range(40):  # a second compaction, after `last` finished: it must keep `last` listed
                if scan(path).records[1]["snapshot"] != first:
                    break
                assert (
                    alice.post(f"{base}/blocks/{a}/extend", json={"token_ids": [300 + i] * 64}).status_code
                    == 200
                )
            assert wait_for(lambda: scan(path).records[1]["snapshot"] != first, timeout=30)
            before = blocks_of(alice, sid)
    # what was written after the last compaction, not all of it: the first loop's extends (each 8
    # copies of one id) are in the snapshot, none in the records replayed after it (a byte bound would
    # move with how many extends a busy machine lets in while the compaction writes)
    tail = scan(path).records
    assert tail[1]["t"] == "base"
    runs = [r["ids"] for r in tail if r["t"] == "tokens"]
    assert not any(_holds(ids, [200 + i] * 8) for ids in runs for i in range(40))
    with running_server(tiny_engine(), settings(journal_dir)) as server:
        ready(server)
        with client(server, KEYS[0]) as alice:
            assert blocks_of(alice, sid) == before
            assert alice.get(f"/v1/sessions/{sid}/blocks/{a}").json()["name"] == "a"
            assert alice.get(f"/v1/sessions/{sid}/coroutines/{last['coroutine']}").json()["tokens"] == 3
            assert alice.get(f"/v1/sessions/{sid}").json()["name"] == "long"
            r = alice.post(
                f"/v1/sessions/{sid}/generate", json={"view": [a, b], "max_tokens": 2, "stream": False}
            )
            assert r.status_code == 200
            assert alice.delete(f"/v1/sessions/{sid}").status_code == 200
    assert not list(journal_dir.iterdir())  # the journal and its snapshot went with the session
