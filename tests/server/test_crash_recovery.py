"""Crash recovery of `cothink serve --journal-dir`: real server processes, killed with SIGKILL while
clients extend blocks and stream generations, restarted on the same directory.

After every restart: every token a client was sent (and every acknowledged extend and truncate) is in
its block, in order; each block holds exactly what the journal files held when the server died (so
nothing the journal never acknowledged); every session answers, to its own key only; interrupted
generations are listed as such; new generations work. Journals are compacted onto snapshots along
the way (a small `--journal-compact-bytes`), so kills also land during compactions and restarts
restore from snapshots plus journal tails.

The default run is 4 sessions x 3 kills. The full run (16 sessions x 20 kills, minutes):

    COTHINK_CRASH_SESSIONS=16 COTHINK_CRASH_ROUNDS=20 pytest tests/server/test_crash_recovery.py -k sigkill
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import tiny_chat_model_dir

from cothink.memory.snapshot import read_snapshot
from cothink.server.journal import SNAPSHOT_SUFFIX, SUFFIX, scan

MAIN = "import sys; from cothink.cli import main; sys.exit(main())"
KEYS = ("key-alice", "key-bob")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`cothink serve --journal-dir DIR` as a child process; its output kept in memory."""

    journal: Path
    extra: tuple[str, ...] = ()
    file_size_limit: int | None = None  # RLIMIT_FSIZE of the child (a disk that fills up)
    proc: subprocess.Popen | None = None
    port: int = 0
    output: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def start(self, timeout: float = 180) -> ServerProcess:
        self.port = free_port()
        cmd = [
            sys.executable,
            "-c",
            MAIN,
            "serve",
            "--model",
            str(tiny_chat_model_dir()),
            "--model-name",
            "tiny",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--journal-dir",
            str(self.journal),
            "--session-idle-s",
            "0",
            *self.extra,
        ]
        for key in KEYS:
            cmd += ["--api-key", key]
        limit = self.file_size_limit

        def limits() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=limits
        )
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            time.sleep(0.05)
        raise AssertionError(f"cothink serve did not become ready:\n{self.log()}")

    def _drain(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.output.append(line)

    def log(self) -> str:
        return "".join(self.output[-200:])

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def journal_blocks(directory: Path) -> dict[str, dict[str, list[int]]]:
    """What the journal files hold, block by block (session -> block -> tokens), read independently
    of the server's replay."""
    out: dict[str, dict[str, list[int]]] = {}
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        blocks: dict[str, list[int]] = {}
        records = scan(path).records
        if not records or any(r["t"] == "deleted" for r in records):
            continue
        for r in records:
            if r["t"] == "block":
                blocks[r["id"]] = list(blocks[r["fork"]]) if r["fork"] else []
            elif r["t"] == "base":  # a compacted journal: the blocks of its snapshot
                saved = read_snapshot(directory / r["snapshot"]).header.blocks
                blocks = {b["id"]: list(h.tokens) for b, h in zip(r["blocks"], saved, strict=True)}
            elif r["t"] == "tokens":
                blocks[r["block"]].extend(r["ids"])
            elif r["t"] == "truncate":
                del blocks[r["block"]][r["length"] :]
            elif r["t"] == "release":
                del blocks[r["block"]]
        out[records[0]["id"]] = blocks
    return out


@dataclass
class Client:
    """One session driven over HTTP: a prompt block it extends and an output block it generates into,
    with everything the server acknowledged."""

    key: str
    sid: str
    prompt: str
    out: str
    acked: dict[str, list[int]]
    rng: random.Random
    inflight: tuple[Any, ...] | None = None  # the operation the crash may have cut short
    generation: str | None = None  # the coroutine of an interrupted generation
    error: BaseException | None = None

    def run(self, server: ServerProcess, stop: threading.Event) -> None:
        try:
            with server.client(self.key) as http:
                while not stop.is_set():
                    self.step(http)
        except (httpx.HTTPError, OSError):
            pass  # the server died under us
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def step(self, http: httpx.Client) -> None:
        base = f"/v1/sessions/{self.sid}"
        roll = self.rng.random()
        if roll < 0.1 and len(self.acked[self.out]) > 8:
            n = self.rng.randrange(len(self.acked[self.out]))
            self.inflight = ("truncate", self.out, n)
            r = http.post(f"{base}/blocks/{self.out}/truncate", json={"length": n})
            assert r.status_code == 200, r.text
            self.acked[self.out] = self.acked[self.out][:n]
        elif roll < 0.45 or sum(map(len, self.acked.values())) > 1500:
            if sum(map(len, self.acked.values())) > 1500:  # stay inside the model's context
                self.inflight = ("truncate", self.prompt, 4)
                r = http.post(f"{base}/blocks/{self.prompt}/truncate", json={"length": 4})
                assert r.status_code == 200, r.text
                self.acked[self.prompt] = self.acked[self.prompt][:4]
                self.inflight = ("truncate", self.out, 0)
                r = http.post(f"{base}/blocks/{self.out}/truncate", json={"length": 0})
                assert r.status_code == 200, r.text
                self.acked[self.out] = []
            ids = [self.rng.randrange(100, 40_000) for _ in range(self.rng.randint(1, 24))]
            self.inflight = ("extend", self.prompt, ids)
            r = http.post(f"{base}/blocks/{self.prompt}/extend", json={"token_ids": ids})
            assert r.status_code == 200, r.text
            self.acked[self.prompt] += ids
        else:
            max_tokens = self.rng.randint(1, 24)
            self.inflight = ("generate", self.out, max_tokens)
            body = {
                "view": [self.prompt, self.out],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": self.rng.randrange(1 << 30),
                "stop_at_eos": False,
            }
            with http.stream("POST", f"{base}/generate", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"] == "start":
                        self.generation = event["coroutine"]
                    elif event["type"] == "token":
                        self.acked[self.out] += event["token_ids"]  # the client has seen these
                    elif event["type"] == "error":
                        raise AssertionError(event)
        self.inflight, self.generation = None, None

    def check(self, http: httpx.Client, journaled: dict[str, list[int]]) -> None:
        """After a restart: the blocks hold what the journal held, which holds all that was acked."""
        base = f"/v1/sessions/{self.sid}"
        r = http.get(f"{base}/blocks", params={"token_ids": "true", "text": "false"})
        assert r.status_code == 200, r.text
        got = {b["id"]: b["token_ids"] for b in r.json()["data"]}
        assert got == journaled, "the restored blocks differ from what the journal holds"
        for block, acked in self.acked.items():
            have = got[block]
            op = self.inflight if self.inflight is not None and self.inflight[1] == block else None
            if op is not None and op[0] == "truncate":
                assert have in (acked, acked[: op[2]]), (block, op, len(acked), len(have))
            else:
                assert have[: len(acked)] == acked, f"a token the client was sent is missing from {block}"
                extra = have[len(acked) :]
                if op is None:
                    assert not extra, f"{block} holds {len(extra)} tokens nobody wrote"
                elif op[0] == "extend":
                    assert extra == op[2][: len(extra)], "extra tokens are not the cut extend's"
                else:
                    assert len(extra) <= op[2], "more tokens than the cut generation could write"
            self.acked[block] = list(have)
        if self.generation is not None:
            co = http.get(f"{base}/coroutines/{self.generation}").json()
            assert co["status"] == "finished" and co["finish_reason"] in ("interrupted", "length"), co
        self.inflight, self.generation = None, None


def new_client(server: ServerProcess, key: str, rng: random.Random) -> Client:
    with server.client(key) as http:
        sid = http.post("/v1/sessions", json={"name": "crash"}).json()["id"]
        prompt = http.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": [1, 2, 3, 4]}).json()["id"]
        out = http.post(f"/v1/sessions/{sid}/blocks").json()["id"]
    return Client(key, sid, prompt, out, {prompt: [1, 2, 3, 4], out: []}, rng)


def test_sigkill_during_extends_and_generations_loses_nothing_acknowledged(tmp_path: Path) -> None:
    sessions = int(os.environ.get("COTHINK_CRASH_SESSIONS", "4"))
    rounds = int(os.environ.get("COTHINK_CRASH_ROUNDS", "3"))
    rng = random.Random(int(os.environ.get("COTHINK_CRASH_SEED", "0")))
    # journals are compacted onto snapshots every few rounds, so kills land during compactions too
    server = ServerProcess(tmp_path / "journal", extra=("--journal-compact-bytes", "8KiB")).start()
    clients = [new_client(server, KEYS[i % 2], random.Random(rng.random())) for i in range(sessions)]
    compacted = 0
    try:
        for _ in range(rounds):
            stop = threading.Event()
            threads = [threading.Thread(target=c.run, args=(server, stop)) for c in clients]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.3, 2.5))
            server.kill()
            stop.set()
            for t in threads:
                t.join(60)
            for c in clients:
                assert c.error is None, f"{c.error!r}\n{server.log()}"
            journaled = journal_blocks(server.journal)
            compacted += sum(1 for _ in server.journal.glob(f"*{SNAPSHOT_SUFFIX}"))
            server.start()
            for c in clients:
                with server.client(c.key) as http:
                    c.check(http, journaled[c.sid])
                with server.client(KEYS[1] if c.key == KEYS[0] else KEYS[0]) as other:
                    assert other.get(f"/v1/sessions/{c.sid}").status_code == 404  # scoping kept
        assert compacted, "no journal was compacted: the test did not cover restoring from a snapshot"
        for c in clients:  # a new generation works on every restored session
            with server.client(c.key) as http:
                r = http.post(
                    f"/v1/sessions/{c.sid}/generate",
                    json={"view": [c.prompt, c.out], "max_tokens": 2, "stream": False},
                )
                assert r.status_code == 200 and len(r.json()["token_ids"]) == 2, r.text
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


def test_a_full_disk_fails_writes_with_507_and_keeps_reads_and_other_sessions(tmp_path: Path) -> None:
    """A file size limit (RLIMIT_FSIZE) makes one session's journal unable to grow, as a full disk
    would: its writes get 507 and change nothing; its reads and a small session go on; after a crash
    the session holds exactly what it acknowledged."""
    limit = 8192
    server = ServerProcess(tmp_path / "journal", file_size_limit=limit).start()
    try:
        big, small = (new_client(server, KEYS[0], random.Random(i)) for i in range(2))
        with server.client(KEYS[0]) as http:
            base = f"/v1/sessions/{big.sid}"
            refused = None
            for i in range(400):
                ids = [random.Random(i).randrange(100, 40_000) for _ in range(16)]
                r = http.post(f"{base}/blocks/{big.prompt}/extend", json={"token_ids": ids})
                if r.status_code == 507:
                    refused = r.json()["error"]
                    break
                assert r.status_code == 200, r.text
                big.acked[big.prompt] += ids
            assert refused is not None and refused["code"] == "journal_unavailable", refused
            assert "File too large" in refused["message"] and str(tmp_path) not in refused["message"]
            blocks = http.get(f"{base}/blocks", params={"token_ids": "true"}).json()["data"]
            assert {b["id"]: b["token_ids"] for b in blocks} == big.acked  # the refused extend left nothing
            r = http.post(
                f"{base}/generate",
                json={"view": [big.prompt, big.out], "max_tokens": 64, "stream": False, "stop_at_eos": False},
            )
            assert r.status_code == 507 and r.json()["error"]["code"] == "journal_unavailable", r.text
            assert (
                http.get(f"{base}/blocks/{big.out}", params={"token_ids": "true"}).json()["token_ids"] == []
            )
            assert http.post(f"{base}/blocks").status_code == 507
            r = http.post(
                f"/v1/sessions/{small.sid}/blocks/{small.prompt}/extend", json={"token_ids": [7, 8]}
            )
            assert r.status_code == 200, r.text
            small.acked[small.prompt] += [7, 8]
        journaled = journal_blocks(server.journal)
        assert (server.journal / f"{big.sid}{SUFFIX}").stat().st_size <= limit
        server.kill()
        server.file_size_limit = None
        server.start()
        for c in (big, small):
            with server.client(c.key) as http:
                c.check(http, journaled[c.sid])
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


def _make_unwritable(directory: Path) -> None:
    if os.geteuid() != 0:
        directory.chmod(0o500)
        return
    # root ignores permission bits; an immutable directory refuses new files to root too
    done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"running as root and chattr +i is not available: {done.stderr.decode().strip()}")


def _make_writable(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    directory.chmod(0o700)


def test_an_unwritable_journal_directory_refuses_new_sessions_with_507(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "journal").start()
    try:
        first = new_client(server, KEYS[0], random.Random(0))
        _make_unwritable(server.journal)
        try:
            with server.client(KEYS[0]) as http:
                r = http.post("/v1/sessions")
                assert r.status_code == 507 and r.json()["error"]["code"] == "journal_unavailable", r.text
                # a session whose journal is already open keeps working
                r = http.post(
                    f"/v1/sessions/{first.sid}/blocks/{first.prompt}/extend", json={"token_ids": [5]}
                )
                assert r.status_code == 200, r.text
                first.acked[first.prompt] += [5]
                assert http.get("/health").status_code == 200
        finally:
            _make_writable(server.journal)
        with server.client(KEYS[0]) as http:
            assert http.post("/v1/sessions").status_code == 201
        journaled = journal_blocks(server.journal)
        server.kill()
        server.start()
        with server.client(KEYS[0]) as http:
            first.check(http, journaled[first.sid])
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()
