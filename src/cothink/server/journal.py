"""The session journal: every change to a session, on disk before any client hears of it.

`cothink serve --journal-dir DIR` keeps one append-only file per session, ``DIR/<session id>.journal``.
The file starts with `MAGIC`; then records, each framed as::

    u32 payload length | u32 crc32(payload) | u32 crc32(the 8 bytes before) | payload (compact JSON)

The header's own checksum tells a length that was cut by a crash (a torn tail) from one that was
damaged in place (a corrupt middle record): `scan` drops a torn tail with a warning and stops at a
damaged record with `JournalCorruptError`, naming the file and the offset.

What is journaled (payload field ``t``):

- ``session`` (id, owner, name, created, model), ``deleted``;
- ``block`` (id, name, created, fork: the source block or null), ``release``, ``truncate`` (length),
  ``seal``;
- ``work`` (co, kind, block, view, name, params: a generation's sampling parameters) when an extend
  or a generation starts writing, and ``end`` (co, finish) when a generation ends (cancels
  included);
- ``tokens`` (block, co, ids): tokens a block gained, attributed to the coroutine that wrote them;
- ``base`` (snapshot, blocks): a compacted journal's start, the session's blocks as saved in
  ``DIR/<snapshot>`` by `engine.save` (`FileJournal.compact`).

The journal mirrors block memory: `Journal.catch_up` compares a block with what its file holds
(length, version, sealed) and appends the difference. It runs after every engine step for blocks
that a coroutine is writing (a step listener: the step's tokens are on file before any caller
resumes, so before any token event, reply or console event can leave), before every token event
and extend reply (where a failure is reported), and before every response of a session route (which
also records truncations). A write that fails (disk full, permissions, a file size limit) leaves
the file as it was (cut back to its last whole record) and fails the request with 507
`journal_unavailable`; the memory the request added is rewound, so nothing that was not journaled is
ever acknowledged. Reads and other sessions go on.

Durability (`JournalSync`): every record reaches the operating system (one `write(2)`) before what
it records is acknowledged, so a crash of the server process loses nothing acknowledged. ``always``
also `fsync`s before acknowledging (a machine crash loses nothing); ``interval`` fsyncs every file
that changed at most `interval_s` (1 s) later (a machine crash loses at most that last second);
``never`` leaves write-back to the operating system (a machine crash loses what it had not written).

Replay (`cothink.server.recovery`) re-creates each session with its ids, loads its base snapshot if
it has one, and re-writes its blocks' tokens under the views they were written under; compaction
(`journal_compact_bytes`) bounds the records replayed per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import json
import logging
import os
import secrets
import signal
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cothink.errors import CothinkError, InvalidParameterError
from cothink.server.errors import APIError

if TYPE_CHECKING:
    from cothink.memory.block import Block
    from cothink.runtime.engine import Engine
    from cothink.scheduler.accounting import StepRecord
    from cothink.server.sessions import BlockEntry, CoroutineEntry, Session
    from cothink.server.settings import ServerSettings

log = logging.getLogger("cothink.server.journal")

MAGIC = b"CTHKJRN1"  # first bytes of every journal file (format version 1)
SUFFIX = ".journal"
SNAPSHOT_SUFFIX = ".snapshot"  # a compacted journal's base: DIR/<session id>.<random>.snapshot
_HEADER = struct.Struct("<III")  # payload length, crc32(payload), crc32(length and payload crc)
MAX_RECORD = 64 << 20  # a longer declared length is damage, not data


class JournalSync(str, enum.Enum):
    """When journal records are fsynced (module docstring: what each can lose)."""

    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class JournalError(CothinkError):
    """A session journal that cannot be written or read."""


class JournalWriteError(JournalError, OSError):
    """A record could not be appended (disk full, permissions, a file size limit)."""


class JournalCorruptError(JournalError, ValueError):
    """A damaged record that is not the file's last: `path` and `offset` name where."""

    def __init__(self, path: Path, offset: int, problem: str):
        super().__init__(f"{path}: damaged journal record at byte {offset}: {problem}")
        self.path, self.offset, self.problem = path, offset, problem


def journal_unavailable(exc: BaseException) -> APIError:
    """The HTTP answer to a write the journal could not take (no server path in the message)."""
    reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else str(exc)
    return APIError(
        507,
        f"the session journal cannot be written ({reason}); the change was not made",
        "storage_error",
        "journal_unavailable",
    )


# ---- framing ---------------------------------------------------------------------------------------
def encode(record: dict[str, Any]) -> bytes:
    """One framed record."""
    payload = json.dumps(record, separators=(",", ":")).encode()
    head = struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@dataclass(frozen=True)
class Scan:
    """A journal file read back: its whole records, where they end, and a dropped torn tail."""

    path: Path
    records: list[dict[str, Any]]
    end: int  # offset just past the last whole record: appends continue here
    torn_bytes: int  # bytes of an incomplete last record, dropped


def scan(path: Path) -> Scan:
    """Read every record of `path`. A torn tail (an incomplete or zero-filled last record) is dropped;
    any other damage raises JournalCorruptError naming the offset."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):  # the file was cut while its first bytes were written
            return Scan(path, [], 0, len(data))
        raise JournalCorruptError(path, 0, "not a cothink session journal")
    records: list[dict[str, Any]] = []
    offset = len(MAGIC)
    while offset < len(data):
        rest = data[offset:]
        if len(rest) < _HEADER.size or not any(rest):
            return Scan(path, records, offset, len(rest))  # cut in its header, or zero-filled
        length, crc, head_crc = _HEADER.unpack_from(rest)
        if zlib.crc32(rest[:8]) != head_crc or length > MAX_RECORD:
            raise JournalCorruptError(path, offset, "the record header fails its checksum")
        end = _HEADER.size + length
        if end > len(rest):
            return Scan(path, records, offset, len(rest))  # the header is whole, the payload cut
        payload = rest[_HEADER.size : end]
        if zlib.crc32(payload) != crc:
            if end == len(rest):  # the last record: its payload was not all written
                return Scan(path, records, offset, len(rest))
            raise JournalCorruptError(path, offset, "the record fails its checksum")
        try:
            record = json.loads(payload)
        except ValueError as exc:
            raise JournalCorruptError(path, offset, f"the record is not JSON ({exc})") from None
        if not isinstance(record, dict) or "t" not in record:
            raise JournalCorruptError(path, offset, "the record has no type")
        records.append(record)
        offset += end
    return Scan(path, records, offset, 0)


# ---- one session's file ----------------------------------------------------------------------------
class JournalFile:
    """An open session journal: appends whole records or none (a failed append is cut back)."""

    def __init__(self, path: Path, fd: int, end: int):
        self.path, self.fd, self.end = path, fd, end  # end: just past the last whole record
        self.dirty = False  # written since the last fsync
        self.broken = False  # the last append failed: cut back before the next one

    @classmethod
    def create(cls, path: Path) -> JournalFile:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        file = cls(path, fd, 0)
        try:
            file._write(MAGIC)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return file

    @classmethod
    def reopen(cls, path: Path, end: int) -> JournalFile:
        """Open an existing journal for appending after its last whole record (a torn tail is cut)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        file = cls(path, fd, end)
        if os.fstat(fd).st_size != end:
            file.broken = True
            try:
                file._repair()
            except OSError:
                pass  # the next append tries again (and fails the request)
        return file

    def _repair(self) -> None:
        os.ftruncate(self.fd, self.end)
        self.broken = False

    def _write(self, data: bytes) -> None:
        view, at = memoryview(data), self.end
        while view:
            n = os.pwrite(self.fd, view, at)
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view, at = view[n:], at + n
        self.end = at
        self.dirty = True

    def append(self, data: bytes, sync: bool) -> None:
        try:
            if self.broken:
                self._repair()
            self._write(data)
            if sync:
                self.sync()
        except OSError as exc:
            self.broken = True
            with contextlib.suppress(OSError):
                self._repair()
            raise JournalWriteError(exc.errno or errno.EIO, f"{self.path}: {exc.strerror or exc}") from None

    def sync(self) -> None:
        if self.dirty:
            self.dirty = False
            os.fsync(self.fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sync()
        with contextlib.suppress(OSError):
            os.close(self.fd)


# ---- the server's journal --------------------------------------------------------------------------
@dataclass(eq=False)
class Tracked:
    """What a block's journal holds: its length, version and seal as last written."""

    session: str
    block_id: str
    block: Block
    length: int
    version: int
    sealed: bool
    writer: str | None = None  # the coroutine writing it now (tokens are attributed to it)


class Journal:
    """Session changes, written to nowhere: the server without `--journal-dir`. `FileJournal` writes
    them; the session code calls the same methods either way."""

    enabled = False

    def session_created(self, session: Session, model: str) -> None: ...
    def session_deleted(self, session: Session) -> None: ...
    def block_added(self, session: Session, entry: BlockEntry, fork_of: BlockEntry | None) -> None: ...
    def block_released(self, session: Session, entry: BlockEntry) -> None: ...
    def work_started(self, session: Session, co: CoroutineEntry, params: dict[str, Any] | None) -> None: ...
    def work_ended(self, session: Session, co: CoroutineEntry) -> None: ...
    def acknowledge(self, session: Session, block: Block) -> None: ...
    def catch_up(self, block: Block) -> None: ...
    def rewind(self, block: Block) -> None: ...
    def settle(self, session_id: str) -> None: ...
    def attach(self, engine: Engine, sessions: dict[str, Session]) -> None: ...
    async def run(self) -> None: ...
    def close(self) -> None: ...


class FileJournal(Journal):
    """One append-only file per session under `directory` (module docstring)."""

    enabled = True

    def __init__(
        self,
        directory: Path,
        sync: JournalSync = JournalSync.INTERVAL,
        interval_s: float = 1.0,
        compact_bytes: int | None = None,
    ):
        self.directory, self.sync, self.interval_s = directory, sync, interval_s
        self.compact_bytes = compact_bytes  # a longer journal is compacted onto a snapshot (None: never)
        self.heads: dict[str, dict[str, Any]] = {}  # session id -> its `session` record
        self.bases: dict[str, str] = {}  # session id -> the snapshot file its journal starts from
        self.compacting: set[str] = set()
        self.tasks: set[asyncio.Task] = set()  # compactions running
        self.started: dict[str, int] = {}  # running writer -> its block's length when it started
        self.next_compaction: dict[str, int] = {}  # session -> journal size that starts the next one
        self.sessions: dict[str, Session] = {}  # the server's live sessions (compaction reads them)
        self.files: dict[str, JournalFile] = {}
        self.tracked: dict[int, Tracked] = {}  # engine block id -> what its file holds
        self.of_session: dict[str, set[int]] = {}  # session id -> its tracked blocks
        self.writing: set[int] = set()  # blocks a coroutine writes now (caught up after every step)
        self.engine: Engine | None = None
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(ValueError, AttributeError):  # main thread only; not on every OS
            # over a file size limit, write(2) fails with EFBIG (a 507) instead of killing the server
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}{SUFFIX}"

    # ---- appending ---------------------------------------------------------------------------------
    def _records(self, session_id: str, records: list[dict[str, Any]]) -> None:
        """Append records (all or none; JournalWriteError). A session without an open file is not
        journaled: one being recovered (its file opens when it is restored) or one being deleted."""
        file = self.files.get(session_id)
        if file is not None and records:
            file.append(b"".join(encode(r) for r in records), self.sync is JournalSync.ALWAYS)

    def open_file(self, session_id: str, file: JournalFile, head: dict[str, Any], base: str | None) -> None:
        self.files[session_id] = file
        self.heads[session_id] = head
        if base is not None:
            self.bases[session_id] = base

    def track(self, session: Session, entry: BlockEntry) -> None:
        b = entry.block
        self.tracked[b.id] = Tracked(session.id, entry.id, b, b.length, b.version, b.sealed)
        self.of_session.setdefault(session.id, set()).add(b.id)

    def untrack(self, block_id: int) -> None:
        tracked = self.tracked.pop(block_id, None)
        self.writing.discard(block_id)
        if tracked is not None:
            self.of_session.get(tracked.session, set()).discard(block_id)

    # ---- session and block records -----------------------------------------------------------------
    def session_created(self, session: Session, model: str) -> None:
        try:
            file = JournalFile.create(self.path(session.id))
        except OSError as exc:
            log.error("cannot create the journal of session %s: %s", session.id, exc)
            raise journal_unavailable(exc) from None
        record = {"t": "session", "id": session.id, "owner": session.owner, "name": session.name,
                  "created": session.created, "model": model}
        try:
            file.append(encode(record), self.sync is not JournalSync.NEVER)
            if self.sync is not JournalSync.NEVER:
                _fsync_directory(self.directory)  # the new file's name survives a machine crash too
        except (JournalWriteError, OSError) as exc:
            file.close()
            with contextlib.suppress(OSError):
                file.path.unlink()
            log.error("cannot write the journal of session %s: %s", session.id, exc)
            raise journal_unavailable(exc) from None
        self.files[session.id] = file
        self.heads[session.id] = record

    def session_deleted(self, session: Session) -> None:
        """Record the deletion, then remove the file (a file left behind is deleted at recovery)."""
        file = self.files.get(session.id)
        if file is None:
            return
        self._write(session.id, [{"t": "deleted"}])
        file.close()
        del self.files[session.id]
        for block_id in self.of_session.pop(session.id, set()):
            self.tracked.pop(block_id, None)
            self.writing.discard(block_id)
        self.heads.pop(session.id, None)
        self.next_compaction.pop(session.id, None)
        base = self.bases.pop(session.id, None)
        with contextlib.suppress(OSError):
            file.path.unlink()
        if base is not None:
            with contextlib.suppress(OSError):
                (self.directory / base).unlink()

    def block_added(self, session: Session, entry: BlockEntry, fork_of: BlockEntry | None) -> None:
        if session.id not in self.files:
            return
        records: list[dict[str, Any]] = []
        if fork_of is not None:
            records += self._diff(self.tracked.get(fork_of.block.id))
        records.append({"t": "block", "id": entry.id, "name": entry.name, "created": entry.created,
                        "fork": fork_of.id if fork_of is not None else None})
        b = entry.block
        if fork_of is None and b.length:  # restored from a snapshot: its tokens, read alone
            records.append({"t": "tokens", "block": entry.id, "co": None, "ids": list(b.tokens)})
        if b.sealed:
            records.append({"t": "seal", "block": entry.id})
        self._write(session.id, records)
        if fork_of is not None:
            self._advance(self.tracked.get(fork_of.block.id))
        self.track(session, entry)

    def block_released(self, session: Session, entry: BlockEntry) -> None:
        self._write(session.id, [{"t": "release", "block": entry.id}])
        self.untrack(entry.block.id)

    # ---- coroutines --------------------------------------------------------------------------------
    def work_started(self, session: Session, co: CoroutineEntry, params: dict[str, Any] | None) -> None:
        """A coroutine starts writing `co.block`: what the block holds so far is caught up first, so
        the tokens after this record are the coroutine's."""
        entry = session.blocks.get(co.block or "")
        if entry is None or session.id not in self.files:
            return
        tracked = self.tracked.get(entry.block.id)
        self._write(session.id, [*self._diff(tracked), _work_record(co, params)])
        self._advance(tracked)
        if tracked is not None and tracked.writer is None:  # else the engine refuses this one (busy)
            tracked.writer = co.id
            self.writing.add(entry.block.id)
            self.started[co.id] = tracked.length

    def work_ended(self, session: Session, co: CoroutineEntry) -> None:
        """The coroutine finished: its last tokens and (a generation's) finish reason. Never raises: a
        failure here has already failed the request that acknowledged the tokens, or will be found by
        the next write to the session."""
        entry = session.blocks.get(co.block or "")
        tracked = self.tracked.get(entry.block.id) if entry is not None else None
        records = self._diff(tracked)
        if co.kind == "generate":
            records.append({"t": "end", "co": co.id, "finish": co.finish_reason or co.status})
        try:
            self._records(session.id, records)
            self._advance(tracked)
        except JournalWriteError as exc:
            log.warning("session %s: could not journal the end of %s: %s", session.id, co.id, exc)
        self.started.pop(co.id, None)
        if tracked is not None and tracked.writer == co.id:
            tracked.writer = None
            self.writing.discard(tracked.block.id)

    # ---- catching up with memory -------------------------------------------------------------------
    def _diff(self, tracked: Tracked | None) -> list[dict[str, Any]]:
        """The records that bring a block's journal up to its memory (without writing them)."""
        if tracked is None:
            return []
        b, out = tracked.block, []
        if b.freed:
            return []
        if b.version != tracked.version or b.length < tracked.length:
            # a truncation (the only change of content): nothing grows a block between a truncation
            # and the next catch-up, since every writer starts with one (work_started)
            cut = min(b.length, tracked.length)
            out.append({"t": "truncate", "block": tracked.block_id, "length": cut})
        start = min(b.length, tracked.length) if out else tracked.length
        if b.length > start:
            out.append({"t": "tokens", "block": tracked.block_id, "co": tracked.writer,
                        "ids": list(b.tokens[start : b.length])})
        if b.sealed and not tracked.sealed:
            out.append({"t": "seal", "block": tracked.block_id})
        return out

    def _advance(self, tracked: Tracked | None) -> None:
        if tracked is not None:
            b = tracked.block
            tracked.length, tracked.version, tracked.sealed = b.length, b.version, b.sealed

    def _write(self, session_id: str, records: list[dict[str, Any]]) -> None:
        """Append records (all or none) or raise 507."""
        try:
            self._records(session_id, records)
        except JournalWriteError as exc:
            log.error("session %s: %s", session_id, exc)
            raise journal_unavailable(exc) from None

    def catch_up(self, block: Block) -> None:
        """Append what `block` gained (or lost) since its journal last caught up; JournalWriteError
        when the file cannot take it (the journal then still holds what it held)."""
        tracked = self.tracked.get(block.id)
        if tracked is None:
            return
        records = self._diff(tracked)
        if records:
            self._records(tracked.session, records)
            self._advance(tracked)

    def acknowledge(self, session: Session, block: Block) -> None:
        """Make sure `block` is journaled before its new content is acknowledged; otherwise rewind
        the memory to what the journal holds (the block must have no writer) and raise 507."""
        try:
            self.catch_up(block)
        except JournalWriteError as exc:
            log.error("session %s: %s", session.id, exc)
            self.rewind(block)
            raise journal_unavailable(exc) from None

    def rewind(self, block: Block) -> None:
        """Cut `block` back to the length its journal holds (after a failed append)."""
        tracked = self.tracked.get(block.id)
        if tracked is None or self.engine is None or block.freed or block.length <= tracked.length:
            return
        try:
            self.engine.truncate(block, tracked.length)
        except Exception as exc:  # still being written: the next catch-up retries the append
            log.warning("could not rewind block %s to its journal: %s", tracked.block_id, exc)
            return
        tracked.version = block.version

    def settle(self, session_id: str) -> None:
        """Catch up every block of a session (before a response of its routes leaves)."""
        for block_id in list(self.of_session.get(session_id, ())):
            tracked = self.tracked.get(block_id)
            if tracked is not None:
                self.catch_up(tracked.block)

    def _on_step(self, record: StepRecord) -> None:
        """After every step, before any caller resumes: the tokens of blocks being written."""
        for block_id in list(self.writing):
            tracked = self.tracked.get(block_id)
            if tracked is None:
                self.writing.discard(block_id)
                continue
            try:
                self.catch_up(tracked.block)
            except JournalWriteError as exc:  # reported by the next token event or reply
                log.warning("session %s: %s", tracked.session, exc)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def attach(self, engine: Engine, sessions: dict[str, Session]) -> None:
        self.engine, self.sessions = engine, sessions
        if self._on_step not in engine.step_listeners:
            engine.step_listeners.append(self._on_step)

    async def run(self) -> None:
        """Every `interval_s`: fsync files that changed (sync 'interval'), and start compacting the
        journals longer than `compact_bytes`."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self.sync is JournalSync.INTERVAL:
                dirty = [f for f in self.files.values() if f.dirty]
                for f in dirty:
                    f.dirty = False
                if dirty:
                    await asyncio.to_thread(_fsync_all, [f.fd for f in dirty])
            if self.compact_bytes is not None:
                for session_id, file in list(self.files.items()):
                    session = self.sessions.get(session_id)
                    due = self.next_compaction.get(session_id, self.compact_bytes)
                    if session is None or session_id in self.compacting or file.end <= due:
                        continue
                    self.compacting.add(session_id)
                    task = asyncio.create_task(self._compact_logged(session), name="cothink-compact")
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)

    def _written(self, session: Session, co: CoroutineEntry) -> list[int]:
        entry = session.blocks.get(co.block or "")
        if entry is None:
            return []
        return list(entry.block.tokens[self.started[co.id] : entry.block.length])

    async def _compact_logged(self, session: Session) -> None:
        try:
            await self.compact(session)
        except Exception:  # the journal stays as it was: complete, only longer
            log.exception("session %s: journal compaction failed", session.id)
        finally:  # the next attempt once the journal grew by compact_bytes again (also after a failure)
            self.compacting.discard(session.id)
            file = self.files.get(session.id)
            if file is not None and self.compact_bytes is not None:
                self.next_compaction[session.id] = file.end + self.compact_bytes

    # ---- compaction --------------------------------------------------------------------------------
    async def compact(self, session: Session) -> None:
        """Replace a session's journal by a snapshot of its blocks (the engine's snapshot format: KV
        and all, restored exactly) plus a new journal that starts from it.

        1. Between steps, with no await in between: every block is caught up, the writers running now
           are noted (their later tokens stay theirs), and `engine.save` copies the blocks, so the
           snapshot holds exactly what the journal holds up to its current end, `mark`.
        2. The snapshot file is written (a worker thread) and fsynced; meanwhile records go on being
           appended to the old journal, after `mark`.
        3. Again with no await: a new journal (`session`, `base` naming the snapshot and its blocks,
           the coroutines' records (`_coroutine_records`), then the old journal's records after
           `mark`, copied as they are) is written beside the old one, fsynced, and renamed over it
           (`_replace`). A crash at any
           point leaves either the old journal or the new one, both complete; a snapshot no journal
           names is deleted at the next start.
        """
        assert self.engine is not None
        file = self.files.get(session.id)
        if file is None or file.broken:
            return
        for block_id in list(self.of_session.get(session.id, ())):
            tracked = self.tracked.get(block_id)
            if tracked is not None:
                self.catch_up(tracked.block)
        entries = [e for e in session.blocks.values() if not e.block.freed]
        base = {"t": "base", "snapshot": f"{session.id}.{secrets.token_hex(6)}{SNAPSHOT_SUFFIX}",
                "blocks": [{"id": e.id, "name": e.name, "created": e.created} for e in entries]}
        coroutines = self._coroutine_records(session)
        mark = file.end
        snapshot = self.directory / base["snapshot"]
        try:
            await self.engine.save(snapshot, [e.block for e in entries])  # copied before its first await
            if self.sync is not JournalSync.NEVER:
                await asyncio.to_thread(_fsync_path, snapshot)
        except BaseException:
            with contextlib.suppress(OSError):
                snapshot.unlink()
            raise
        current = self.files.get(session.id)
        if current is not file or file.broken:  # deleted, or its journal failed meanwhile
            with contextlib.suppress(OSError):
                snapshot.unlink()
            return
        replacement = self._replace(file, [self.heads[session.id], base, *coroutines], mark, snapshot)
        self.files[session.id] = replacement
        file.close()
        old = self.bases.get(session.id)
        self.bases[session.id] = base["snapshot"]
        if old is not None:
            with contextlib.suppress(OSError):
                (self.directory / old).unlink()
        log.info("session %s: journal compacted from %d to %d bytes", session.id, mark, replacement.end)

    def _coroutine_records(self, session: Session) -> list[dict[str, Any]]:
        """A compacted journal's coroutines: the finished generations' `work` and `end` (listed after a
        restart, as an uncompacted journal lists them), then the running writers' `work` with what
        they wrote before the snapshot (in it, and theirs)."""
        records = []
        for co in session.coroutines.values():
            if co.kind == "generate" and not co.running and co.block is not None:
                records += [_work_record(co, None, list(co.token_ids)),
                            {"t": "end", "co": co.id, "finish": co.finish_reason or co.status}]
        records += [_work_record(co, None, self._written(session, co))
                    for co in session.running() if co.id in self.started]
        return records

    def _replace(
        self, file: JournalFile, head: list[dict[str, Any]], mark: int, snapshot: Path
    ) -> JournalFile:
        """Write `head` and the old journal's records after `mark` beside it, fsynced, and rename the
        result over it; on a failure both the new file and `snapshot` are removed."""
        tail = os.pread(file.fd, file.end - mark, mark) if file.end > mark else b""
        fresh = file.path.with_name(file.path.name + ".next")
        with contextlib.suppress(OSError):
            fresh.unlink()
        try:
            replacement = JournalFile.create(fresh)
            replacement.append(b"".join(encode(r) for r in head) + tail, self.sync is not JournalSync.NEVER)
            os.replace(fresh, file.path)
            replacement.path = file.path
            if self.sync is not JournalSync.NEVER:
                _fsync_directory(self.directory)
        except (OSError, JournalWriteError):
            with contextlib.suppress(OSError):
                fresh.unlink()
            with contextlib.suppress(OSError):
                snapshot.unlink()
            raise
        return replacement

    def close(self) -> None:
        if self.engine is not None and self._on_step in self.engine.step_listeners:
            self.engine.step_listeners.remove(self._on_step)
        for file in self.files.values():
            file.close()
        self.files.clear()


def _work_record(co: CoroutineEntry, params: dict[str, Any] | None,
                 tokens: list[int] | None = None) -> dict[str, Any]:
    """A coroutine's `work` record; `tokens`: what it wrote before a compaction's snapshot."""
    record = {"t": "work", "co": co.id, "kind": co.kind, "block": co.block, "view": co.view,
              "name": co.name, "params": params}
    if tokens is not None:
        record["tokens"] = tokens
    return record


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):  # a file closed meanwhile
            os.fsync(fd)


def journal_files(directory: Path) -> Iterator[Path]:
    return iter(sorted(directory.glob(f"*{SUFFIX}")))


def open_journal(settings: ServerSettings) -> Journal:
    """The journal `settings` ask for: files under `journal_dir`, or none."""
    if settings.journal_dir is None:
        return Journal()
    try:
        sync = JournalSync(settings.journal_sync)
    except ValueError:
        raise InvalidParameterError(
            f"journal_sync must be always, interval or never, got {settings.journal_sync!r}",
            param="journal_sync",
        ) from None
    if not 0 < settings.journal_sync_interval_s <= 1:
        raise InvalidParameterError(
            "journal_sync_interval_s must be in (0, 1] seconds", param="journal_sync_interval_s"
        )
    directory = Path(settings.journal_dir).expanduser()
    try:
        return FileJournal(directory, sync, settings.journal_sync_interval_s, settings.journal_compact_bytes)
    except OSError as exc:
        raise JournalError(f"cannot use the journal directory {directory}: {exc.strerror or exc}") from None
