"""Session journal cost: what `--journal-dir` adds per generated token, per `--journal-sync` mode, and
how long a server takes to restore the sessions from the journal.

    python bench/journal.py            # SmolLM2, a few minutes on a 2-core CPU
    python bench/journal.py --quick    # fewer sessions and tokens

For each mode (no journal, never, interval, always) a server (in this process, on a loopback port)
runs the same workload: `--sessions` sessions, each a prompt block extended with `--prompt` tokens and
`--rounds` streamed greedy generations of `--tokens` tokens into a second block, all sessions at once
over HTTP. Reported per mode: wall seconds, seconds per generated token, journal bytes and the
overhead against no journal. Then a fresh server restores the last journal directory: recovery
seconds and tokens replayed per second.

Recovery at size (`--recovery-tokens`, default 100,000; 0: skip): `--recovery-sessions` sessions (16)
each write their share of the tokens into a block (one extend), once with compaction off and once
with every journal compacted onto a snapshot; a fresh server restores each directory, timed from
its start to the end of recovery. Writes journal.json to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODES = ("off", "never", "interval", "always")


def _session(url: str, prompt: list[int], rounds: int, tokens: int) -> int:
    with httpx.Client(base_url=url, timeout=600) as http:
        sid = http.post("/v1/sessions").json()["id"]
        a = http.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": prompt}).json()["id"]
        b = http.post(f"/v1/sessions/{sid}/blocks").json()["id"]
        n = 0
        for _ in range(rounds):
            body = {"view": [a, b], "max_tokens": tokens, "stop_at_eos": False}
            with http.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
                n += sum(1 for line in r.iter_lines() if line.startswith('data: {"type":"token"'))
        return n


def _wait_ready(url: str) -> float:
    start = time.perf_counter()
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.01)


def run_mode(args: argparse.Namespace, folder: Path, mode: str, journal: Path | None) -> dict[str, Any]:
    import cothink
    from cothink.server import BackgroundServer, ServerSettings, create_app

    journaled = {"journal_dir": str(journal), "journal_sync": mode} if journal is not None else {}
    settings = ServerSettings(model_name="bench", session_idle_s=None, **journaled)
    engine = cothink.Engine.from_pretrained(folder)
    with BackgroundServer(create_app(engine, settings)) as server:
        _wait_ready(server.url)
        prompt = list(range(1000, 1000 + args.prompt))
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
            futures = [pool.submit(_session, server.url, prompt, args.rounds, args.tokens)
                       for _ in range(args.sessions)]
            generated = sum(f.result() for f in futures)
        wall = time.perf_counter() - start
    size = sum(p.stat().st_size for p in journal.iterdir()) if journal is not None else 0
    return {"mode": mode, "wall_s": wall, "tokens": generated, "s_per_token": wall / max(generated, 1),
            "journal_bytes": size}


def run_recovery(folder: Path, journal: Path, kv_tokens: int | None = None) -> dict[str, Any]:
    """A fresh server on `journal`: its recovery report, and the seconds from its start to ready."""
    import cothink
    from cothink.server import BackgroundServer, ServerSettings, create_app

    start = time.perf_counter()
    limits = {} if kv_tokens is None else {"kv_tokens": kv_tokens}
    settings = ServerSettings(model_name="bench", session_idle_s=None, journal_dir=str(journal))
    app = create_app(cothink.Engine.from_pretrained(folder, **limits), settings)
    with BackgroundServer(app) as server:
        _wait_ready(server.url)
        report = server.call(lambda: app.state.cothink.recovery.report())
    return {**report, "tokens_per_s": report["tokens_replayed"] / max(report["seconds"], 1e-9),
            "start_to_ready_s": time.perf_counter() - start}


def _write_sessions(url: str, sessions: int, tokens: int) -> None:
    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=3600) as http:
            sid = http.post("/v1/sessions").json()["id"]
            ids = [1000 + (i * 7919 + j) % 30000 for j in range(tokens)]
            r = http.post(f"/v1/sessions/{sid}/blocks", json={"token_ids": ids})
            r.raise_for_status()

    with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
        list(pool.map(one, range(sessions)))


def run_recovery_at_size(
    args: argparse.Namespace, folder: Path, journal: Path, compact: bool
) -> dict[str, Any]:
    """Journal `--recovery-tokens` across `--recovery-sessions` sessions (compacted onto snapshots or
    not), then time a fresh server's recovery of them."""
    import cothink
    from cothink.server import BackgroundServer, ServerSettings, create_app

    per_session = args.recovery_tokens // args.recovery_sessions
    settings = ServerSettings(model_name="bench", session_idle_s=None, journal_dir=str(journal),
                              journal_compact_bytes=1024 if compact else None)
    app = create_app(cothink.Engine.from_pretrained(folder, kv_tokens=args.recovery_tokens + 4096), settings)
    with BackgroundServer(app) as server:
        _wait_ready(server.url)
        _write_sessions(server.url, args.recovery_sessions, per_session)
        if compact:  # every journal compacted onto its snapshot (the sync loop starts them within a second)
            state = app.state.cothink
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline:
                done = len(list(journal.glob("*.snapshot"))) >= args.recovery_sessions
                if done and not server.call(lambda: bool(state.journal.compacting)):
                    break
                time.sleep(0.2)
    size = sum(p.stat().st_size for p in journal.iterdir())
    tokens = per_session * args.recovery_sessions
    recovery = run_recovery(folder, journal, kv_tokens=args.recovery_tokens + 4096)
    return {"compacted": compact, "sessions": args.recovery_sessions, "tokens": tokens,
            "directory_bytes": size, **recovery}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="tokens per generation (default 32)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per session (default 64)")
    p.add_argument("--recovery-tokens", type=int, default=100_000,
                   help="tokens journaled for the recovery-at-size measurement (default 100000; 0: skip)")
    p.add_argument("--recovery-sessions", type=int, default=16)
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.rounds, args.tokens = 4, 2, 16
        args.recovery_tokens, args.recovery_sessions = min(args.recovery_tokens, 512), 4
    info, folder = C.begin(args, "session journal")
    rows, last_dir = [], None
    with tempfile.TemporaryDirectory(prefix="cothink-journal-bench-") as tmp:
        for mode in MODES:
            journal = None if mode == "off" else Path(tmp) / mode
            rows.append(run_mode(args, folder, mode, journal))
            last_dir = journal or last_dir
        assert last_dir is not None
        recovery = run_recovery(folder, last_dir)
        at_size = [run_recovery_at_size(args, folder, Path(tmp) / f"size-{c}", c)
                   for c in (False, True)] if args.recovery_tokens else []
    base = rows[0]["s_per_token"]
    for row in rows:
        row["overhead"] = row["s_per_token"] / base - 1
    result = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "modes": rows,
              "recovery": recovery, "recovery_at_size": at_size}
    path = C.write_json(args.out / "journal.json", result)
    con = C.console()
    for row in rows:
        con.print(f"{row['mode']:8s} {row['s_per_token'] * 1e3:7.2f} ms/token  "
                  f"overhead {row['overhead']:+6.1%}"
                  f"  journal {row['journal_bytes'] / 1024:8.1f} KiB")
    con.print(f"recovery ({last_dir.name}): {recovery['sessions_restored']} sessions, "
              f"{recovery['tokens_replayed']} tokens in {recovery['seconds']:.2f} s "
              f"({recovery['tokens_per_s']:.0f} tokens/s)")
    for r in at_size:
        con.print(f"recovery of {r['tokens']} tokens in {r['sessions']} sessions "
                  f"({'compacted onto snapshots' if r['compacted'] else 'journals only'}, "
                  f"{r['directory_bytes'] / 2**20:.1f} MiB): {r['seconds']:.2f} s "
                  f"({r['tokens_replayed']} tokens replayed; server start to ready "
                  f"{r['start_to_ready_s']:.1f} s)")
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
