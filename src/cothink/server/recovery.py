"""Restore every journaled session when a server starts on a journal directory (docs/server.md,
"Journal and crash recovery").

Each session comes back with its id, its owner (API-key scoping intact), its name and its blocks with
their ids, labels and every journaled token: a compacted journal's blocks are loaded from its base
snapshot, the records after it replayed. Blocks are re-written under the views their tokens were
written under, in journal order (tokens a coroutine wrote in a row are re-written as one extend,
before anything that reads or changes their block or a block of their view). Generations the crash
interrupted are listed with finish reason ``interrupted``; their blocks stay usable.

A file whose last record is torn loses that record (a warning); a file with a damaged record
elsewhere is not restored (an error naming the file and offset; the file is kept); the other
sessions restore either way. The server answers only ``/health`` (status ``recovering``, with
`RecoveryProgress`) until recovery ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cothink.memory.snapshot import read_snapshot
from cothink.observability.logs import bind_owner
from cothink.server.journal import (
    SNAPSHOT_SUFFIX,
    SUFFIX,
    FileJournal,
    JournalCorruptError,
    JournalError,
    JournalFile,
    encode,
    journal_files,
    scan,
)
from cothink.server.sessions import BlockEntry, CoroutineEntry, Session

if TYPE_CHECKING:
    from cothink.server.state import ServerState

log = logging.getLogger("cothink.server.journal")

PARALLEL_SESSIONS = 8  # sessions replayed at once (their extends share engine steps)


@dataclass
class RecoveryProgress:
    """What /health reports while (and after) the journal is replayed."""

    running: bool = True
    sessions_total: int = 0
    sessions_restored: int = 0
    sessions_failed: int = 0
    tokens_replayed: int = 0
    torn_tails: int = 0
    errors: list[str] = field(default_factory=list)  # one per session that could not be restored
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def report(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "sessions_total": self.sessions_total,
            "sessions_restored": self.sessions_restored,
            "sessions_failed": self.sessions_failed,
            "tokens_replayed": self.tokens_replayed,
            "torn_tails": self.torn_tails,
            "errors": list(self.errors),
            "seconds": round(self.seconds if not self.running else time.monotonic() - self.started, 3),
        }


@dataclass
class _Work:
    """A journaled coroutine that wrote into a block."""

    id: str
    kind: str
    block: str
    view: list[str]
    name: str | None
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # None: the crash interrupted it


@dataclass
class _Pending:
    """Tokens written in a row by one coroutine (or, with `co` None, written alone), not replayed yet."""

    co: str | None
    view: list[str]
    ids: list[int]


class SessionReplay:
    """One session's records, applied in order to a fresh session with the journaled ids."""

    def __init__(
        self, state: ServerState, path: Path, records: list[dict[str, Any]], progress: RecoveryProgress
    ):
        self.state, self.path, self.records, self.progress = state, path, records, progress
        self.session: Session | None = None
        self.works: dict[str, _Work] = {}
        self.pending: dict[str, _Pending] = {}
        self.base: str | None = None  # the snapshot a compacted journal starts from

    @property
    def engine(self):
        return self.state.engine

    def _entry(self, block_id: str) -> BlockEntry:
        assert self.session is not None
        entry = self.session.blocks.get(block_id)
        if entry is None:
            raise JournalError(f"{self.path}: a record names block {block_id!r}, never made in the journal")
        return entry

    async def run(self) -> Session:
        first = self.records[0]
        if first.get("t") != "session":
            raise JournalError(f"{self.path}: the journal does not start with its session")
        model = first.get("model")
        if model is not None and model != self.state.settings.model_name:
            raise JournalError(
                f"{self.path}: written by a server of model {model!r}; this one serves "
                f"{self.state.settings.model_name!r}"
            )
        manager = self.state.sessions
        session = Session(manager, first["owner"], first.get("name"), session_id=first["id"])
        session.created = int(first.get("created", session.created))
        self.session = session
        try:
            for record in self.records[1:]:
                await self.apply(record)
            await self.flush_all()
        except BaseException:
            session.close()
            raise
        for work in self.works.values():
            if work.kind == "generate":
                self._listed(work)
        manager.sessions[session.id] = session
        bind_owner(session.id, session.id)
        return session

    async def apply(self, record: dict[str, Any]) -> None:
        kind, session = record["t"], self.session
        assert session is not None
        if kind == "block":
            source = record.get("fork")
            if source is not None:
                await self.flush_touching(source)
            fork_of = self._entry(source) if source is not None else None
            entry = session.new_block(record.get("name"), fork_of, block_id=record["id"])
            entry.created = int(record.get("created", entry.created))
        elif kind == "tokens":
            block_id, co = record["block"], record.get("co")
            work = self.works.get(co) if co is not None else None
            view = work.view if work is not None else [block_id]
            await self.flush_touching(block_id, keep_own=True)
            pending = self.pending.get(block_id)
            if pending is not None and pending.co != co:
                await self.flush(block_id)
                pending = None
            if pending is None:
                self.pending[block_id] = _Pending(co, view, list(record["ids"]))
            else:
                pending.ids.extend(record["ids"])
            if work is not None:
                work.tokens.extend(record["ids"])
        elif kind == "truncate":
            await self.flush_touching(record["block"])
            self.engine.truncate(self._entry(record["block"]).block, int(record["length"]))
        elif kind == "seal":
            await self.flush_touching(record["block"])
            self.engine.seal(self._entry(record["block"]).block)
        elif kind == "release":
            await self.flush_touching(record["block"])
            session.delete_block(record["block"])
        elif kind == "base":  # a compacted journal starts from a snapshot of the session's blocks
            name = str(record["snapshot"])
            if Path(name).name != name or not name.endswith(SNAPSHOT_SUFFIX):
                raise JournalError(f"{self.path}: the base record names {name!r}, not a snapshot of DIR")
            path = self.path.parent / name
            loaded = await asyncio.to_thread(read_snapshot, path)
            blocks = self.engine.load(loaded)
            for block, meta in zip(blocks, record["blocks"], strict=True):
                entry = session.adopt_block(meta["id"], block, meta.get("name"))
                entry.created = int(meta.get("created", entry.created))
            self.base = record["snapshot"]
        elif kind == "work":
            self.works[record["co"]] = _Work(
                record["co"], record["kind"], record["block"], list(record["view"]), record.get("name"),
                list(record.get("tokens", [])),  # a compacted journal: what it wrote before the snapshot
            )
        elif kind == "end":
            work = self.works.get(record["co"])
            if work is not None:
                work.finish = record.get("finish")
        else:
            raise JournalError(f"{self.path}: unknown record type {kind!r}")

    async def flush_touching(self, block_id: str, keep_own: bool = False) -> None:
        """Replay pending tokens that must come before a change to `block_id`: the block's own, and
        those of writers that read it (they read it as it was before the change)."""
        for other, pending in list(self.pending.items()):
            if (other == block_id and not keep_own) or (other != block_id and block_id in pending.view):
                await self.flush(other)

    async def flush(self, block_id: str) -> None:
        pending = self.pending.pop(block_id, None)
        if pending is None or not pending.ids:
            return
        assert self.session is not None
        view = [v for v in pending.view if v in self.session.blocks and v != block_id] + [block_id]
        blocks = [self._entry(v).block for v in view]
        await self.engine.extend(blocks[-1], token_ids=pending.ids, view=blocks)
        self.progress.tokens_replayed += len(pending.ids)

    async def flush_all(self) -> None:
        for block_id in list(self.pending):
            await self.flush(block_id)

    def _listed(self, work: _Work) -> None:
        """A journaled generation as GET .../coroutines lists it."""
        assert self.session is not None
        co = CoroutineEntry(work.id, "generate", work.name, work.view, work.block, int(time.time()))
        co.status = "finished"
        co.finish_reason = work.finish or "interrupted"
        co.token_ids = list(work.tokens)
        co.text = self.state.decode(work.tokens)
        self.session.coroutines[co.id] = co
        bind_owner(co.id, self.session.id)
        keep = self.state.settings.session_keep_finished
        while len(self.session.coroutines) > keep:
            self.session.coroutines.popitem(last=False)

    def interrupted(self) -> list[str]:
        return [w.id for w in self.works.values() if w.kind == "generate" and w.finish is None]


async def recover(state: ServerState, journal: FileJournal, progress: RecoveryProgress) -> None:
    """Restore every session journaled under `journal.directory`, then keep journaling them."""
    paths = list(journal_files(journal.directory))
    progress.sessions_total = len(paths)
    for leftover in journal.directory.glob(f"*{SUFFIX}.next"):  # a compaction the crash cut short
        with contextlib.suppress(OSError):
            leftover.unlink()
    gate = asyncio.Semaphore(PARALLEL_SESSIONS)

    async def one(path: Path) -> None:
        async with gate:
            await _recover_file(state, journal, path, progress)

    try:
        await asyncio.gather(*(one(p) for p in paths))
        _delete_unnamed_snapshots(journal)
    finally:
        progress.running = False
        progress.seconds = time.monotonic() - progress.started
        log.info(
            "journal recovery: %d sessions restored, %d failed, %d tokens replayed in %.2f s",
            progress.sessions_restored, progress.sessions_failed, progress.tokens_replayed, progress.seconds,
        )


async def _recover_file(
    state: ServerState, journal: FileJournal, path: Path, progress: RecoveryProgress
) -> None:
    try:
        result = await asyncio.to_thread(scan, path)
    except (OSError, JournalCorruptError) as exc:
        _failed(progress, path, exc)
        return
    if result.torn_bytes:
        progress.torn_tails += 1
        log.warning(
            "%s: dropped a torn last record (%d bytes at offset %d)", path, result.torn_bytes, result.end
        )
    records = result.records
    if not records or any(r["t"] == "deleted" for r in records):
        with contextlib.suppress(OSError):  # a session deleted, or never acknowledged as created
            path.unlink()
        progress.sessions_total -= 1
        return
    replay = SessionReplay(state, path, records, progress)
    try:
        session = await replay.run()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        _failed(progress, path, exc)
        return
    try:
        file = JournalFile.reopen(path, result.end)
    except OSError as exc:  # restored, but its changes cannot be journaled: every write gets 507
        log.error("%s: cannot reopen the journal for appending: %s", path, exc)
    else:
        journal.open_file(session.id, file, records[0], replay.base)
        for entry in session.blocks.values():
            journal.track(session, entry)
        ends = [{"t": "end", "co": co, "finish": "interrupted"} for co in replay.interrupted()]
        if ends:
            with contextlib.suppress(JournalError):
                file.append(b"".join(encode(r) for r in ends), sync=False)
    progress.sessions_restored += 1


def _failed(progress: RecoveryProgress, path: Path, exc: BaseException) -> None:
    progress.sessions_failed += 1
    message = str(exc) if isinstance(exc, JournalError) else f"{path}: {type(exc).__name__}: {exc}"
    progress.errors.append(message)
    log.error("journal recovery: session not restored: %s", message)


def _delete_unnamed_snapshots(journal: FileJournal) -> None:
    """Delete the snapshots no restored journal starts from (a compaction a crash cut short), but
    keep those of sessions that could not be restored (their files are kept for repair)."""
    named = set(journal.bases.values())
    unrestored = {p.name.removesuffix(SUFFIX) for p in journal_files(journal.directory)} - set(journal.files)
    for snapshot in journal.directory.glob(f"*{SNAPSHOT_SUFFIX}"):
        if snapshot.name not in named and snapshot.name.split(".", 1)[0] not in unrestored:
            with contextlib.suppress(OSError):
                snapshot.unlink()
